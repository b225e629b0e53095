"""The gpu worker's start-up decisions, on CPU: which device it works on, pinning the
region before the hello (refused unless allowed, with the reason), and the pinned
state travelling in the hello to the broker's stats."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

import workers.gpu.pinning as pinning
from broker.core import BrokerCore
from tests.integration.cluster import make_config
from tierkv.core.primary import PrimaryTier
from tierkv.core.shm import SharedRegion, process_start_time
from tierkv.core.tiering import TieringManager
from tierkv.node.children import ChildRegistry
from tierkv.node.config import ConfigError
from tierkv.wire.protocol import WorkerHello, decode, encode
from workers.gpu.pinning import Pinned
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
