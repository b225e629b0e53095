"""The gpu worker's start-up decisions, on CPU: which device it works on, pinning the
region before the hello (refused unless allowed, with the reason), and the pinned
state travelling in the hello to the broker's stats."""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import workers.gpu.copy_cpu as copy_cpu
import workers.gpu.pinning as pinning
from broker.core import BrokerCore
from tests.integration.cluster import make_config
from tierkv.core.errors import ErrorCode
from tierkv.core.primary import PrimaryTier
from tierkv.core.shm import SharedRegion, process_start_time
from tierkv.core.tiering import TieringManager
from tierkv.engine import KVLayout, OpenedKV
from tierkv.node.children import ChildRegistry
from tierkv.node.config import ConfigError
from tierkv.wire.protocol import TransferJob, WorkerHello, decode, encode
from workers.gpu.pinning import Pinned
from workers.gpu.streams import HostOrder
from workers.gpu.transfer import TransferEngine
from workers.gpu_worker import UnpinnedRefused, WorkerService, _device_arg, resolve_device


def test_device_argument_and_resolution_without_cuda():
    assert [_device_arg(v) for v in ("auto", "cpu", "cuda", "cuda:3")] == [
        "auto", "cpu", "cuda", "cuda:3"]
    for bad in ("gpu", "cuda:", "cuda:x", "cuda:-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="auto, cpu, cuda or cuda:N"):
            _device_arg(bad)
    assert resolve_device("cpu", 3) == ("cpu", None)
    assert resolve_device("auto", 1) == ("cpu", None)  # this machine has no GPU
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        resolve_device("cuda:1", 1)


def test_pinned_state_travels_in_the_hello_to_the_broker_stats(tmp_path: Path):
    token = ChildRegistry.new_token()
    ChildRegistry(tmp_path).add(token, "worker0", os.getpid())  # as the supervisor records
    hello = WorkerHello(0, 1, os.getpid(), process_start_time(os.getpid()) or 0, "cuda:0",
                        None, False, token=token)
    assert decode(encode(hello)) == hello
    assert decode(encode(WorkerHello(0, 1, 5))).pinned is None  # older workers, CPU workers
    config = make_config("pinstate", tmp_path, tiers=[])
    core = BrokerCore(config, TieringManager(PrimaryTier(16, "lru")), {}, lambda *a: True)
    core.on_worker(b"worker:0:1", hello)
    (peer,) = core.stats()["peers"]
    assert (peer["kind"], peer["pinned"], peer["kv_attached"]) == ("worker", False, False)


@pytest.fixture
def failing_pin(monkeypatch):
    """cudaHostRegister refused, as with a low `ulimit -l`; unpins are recorded."""
    calls: dict[str, list] = {"pin": [], "unpin": []}

    def pin(ptr: int, size: int, device: int | None = None) -> Pinned:
        calls["pin"].append(device)
        return Pinned(ptr, size, False, 0.01,
                      "cudaHostRegister failed with cudaError 2 (cudaErrorMemoryAllocation)")

    monkeypatch.setattr(pinning, "pin_host", pin)
    monkeypatch.setattr(pinning, "unpin_host",
                        lambda ptr, device=None: calls["unpin"].append(device) or 0.0)
    return calls


@pytest.mark.parametrize("allowed", [False, True])
def test_an_unpinnable_region_stops_the_worker_before_its_hello(tmp_path, instance,
                                                                failing_pin, allowed):
    config = make_config(instance, tmp_path, tiers=[], gpu={"allow_unpinned": allowed})
    with SharedRegion.create(instance, 16, 1024):
        service = WorkerService(config, 0, "cuda", cuda_index=2)
        if not allowed:
            with pytest.raises(UnpinnedRefused, match=r"cudaErrorMemoryAllocation.*ulimit -l"
                               r".*allow_unpinned = true"):
                service._attach_region()
            assert failing_pin == {"pin": [2], "unpin": [2]}  # under the worker's GPU
            assert service.pinned is None
        else:
            attached = service._attach_region()
            assert service.pinned.pinned is False
            service._unpin()
            attached.close()
            assert failing_pin == {"pin": [2], "unpin": [2]}


# -- the CPU copy path's ordering point (the analogue of the CUDA stream wait) ------------


@contextlib.contextmanager
def cpu_copier(instance: str, order: HostOrder) -> Iterator[tuple[torch.Tensor, TransferEngine,
                                                                   SharedRegion]]:
    """A CPU KV cache of 4 blocks of 256 bytes, attached to a copy engine that orders
    its jobs after `order`; the region unlinked at the end."""
    tensor = torch.zeros(4, 256, dtype=torch.int8)
    kv = OpenedKV.local([tensor], KVLayout(4, 16, "int8", ((4, 256),), 0))
    region = SharedRegion.create(instance, 4, 256)
    try:
        with TransferEngine(region, 0, "cpu", order=order) as engine:
            engine.attach(kv)
            yield tensor, engine, region
    finally:
        kv.close()
        region.close()
        region.unlink()


def test_a_cpu_store_waits_for_the_fence_its_submitter_hands(instance):
    """A model still writing block 1 when its store is submitted: the copy waits for
    the fence asked on the submitting thread, so it stores the final bytes."""
    fence = threading.Event()
    asked: list[threading.Thread] = []

    def order() -> threading.Event:
        asked.append(threading.current_thread())
        return fence

    with cpu_copier(instance, order) as (tensor, engine, region):
        tensor[1] = 1  # the model half-way
        engine.submit(TransferJob(1, "store", [1], [2]))
        tensor[1] = 7  # its final bytes, written after the store was submitted
        fence.set()
        (outcome,) = engine.wait(timeout=30)
        assert outcome.success
        assert (np.asarray(region.numpy())[2, :256] == 7).all()
    assert asked == [threading.current_thread()]


def test_a_cpu_copy_whose_fence_never_comes_fails_and_copies_nothing(instance, monkeypatch):
    monkeypatch.setattr(copy_cpu, "FENCE_TIMEOUT_S", 0.0)
    with cpu_copier(instance, threading.Event) as (tensor, engine, region):
        tensor[1] = 7
        engine.submit(TransferJob(1, "store", [1], [2]))
        (outcome,) = engine.wait(timeout=30)
        assert (outcome.success, outcome.error_code) == (False, ErrorCode.TIMEOUT)
        assert not np.asarray(region.numpy())[2].any()


# -- pinning in pieces ---------------------------------------------------------------------


class RecordingRegistrar:
    """`HostRegistrar` that records the calls; the piece at `fail_at` (an address)
    is refused as a driver refuses it."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, ptr: int, size: int) -> int:
        if ptr == self.fail_at:
            return 2
        self.registered.append((ptr, size))
        return 0

    def unregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def error_name(self, rc: int) -> str:
        return "cudaErrorMemoryAllocation"


def test_a_region_is_pinned_in_pieces_and_unpinned_whole(monkeypatch):
    monkeypatch.setattr(pinning, "PIECE_BYTES", 1 << 20)
    calls = RecordingRegistrar()
    base, size = 1 << 40, (5 << 20) + 4096  # five whole pieces and a short one
    pinned = pinning.pin_host(base, size, registrar=calls)
    assert pinned.pinned and pinning.is_pinned(base)
    assert calls.registered == [(base + i * (1 << 20), 1 << 20) for i in range(5)] + [
        (base + (5 << 20), 4096)]
    pinning.unpin_host(base)
    assert sorted(calls.unregistered) == [p for p, _ in calls.registered]
    assert pinning.is_pinned(base) is None


def test_a_refused_piece_unpins_the_others_and_says_what_to_do(monkeypatch):
    monkeypatch.setattr(pinning, "PIECE_BYTES", 1 << 30)
    base = 1 << 41
    calls = RecordingRegistrar(fail_at=base + (3 << 30))
    pinned = pinning.pin_host(base, 8 << 30, registrar=calls)
    assert not pinned.pinned and pinning.is_pinned(base) is False
    assert len(calls.registered) == 3
    assert sorted(calls.unregistered) == [p for p, _ in calls.registered]  # none left
    assert "cudaErrorMemoryAllocation) on the piece at 3.0 GiB of 8.0 GiB" in pinned.error
    message = pinning.refuse_message(pinned)
    assert "ulimit -l" in message and "allow_unpinned" in message
    pinning.unpin_host(base)  # the failed registration's reference: nothing to undo
    assert len(calls.unregistered) == 3 and pinning.is_pinned(base) is None
