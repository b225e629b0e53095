"""A real node for tests: broker, CPU workers and tier processes as real processes,
driven by a test that plays the inference engine (it owns the KV cache)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.client import Client, Step
from tierkv.node.config import Config, config_from_dict
from tierkv.node.supervisor import Node

# 2 layers x K/V x 4 tokens x 2 heads x 16 dims x fp16 = 1 KiB per block and rank.
LAYOUT = dict(num_layers=2, block_size_tokens=4, num_kv_heads=2, head_dim=16, dtype="float16")


def key_bytes(key: bytes, rank: int, size: int) -> bytes:
    """The bytes a block of `key` holds on `rank`: derived, so any copy is checkable."""
    out = bytearray()
    seed = key + rank.to_bytes(2, "big")
    while len(out) < size:
        seed = hashlib.blake2b(seed, digest_size=64).digest()
        out += seed
    return bytes(out[:size])


def keys(*ns: int, prefix: bytes = b"k") -> list[bytes]:
    return [prefix + n.to_bytes(8, "big") for n in ns]


class Cluster:
    def __init__(self, config: Config, gpu_blocks: int) -> None:
        self.config = config
        from tierkv.engine import KVLayout

        self.node = Node(config)
        self.layout = KVLayout.blocks_outer(num_blocks=gpu_blocks, **LAYOUT)
        self.kv: list[Any] = []
        self.clients: list[Client] = []
        self.registration_tokens: dict[int, str] = {}

    def start(self) -> Cluster:
        from tierkv.engine import allocate_kv_cache

        self.node.start()
        try:
            c = self.client()
            for rank in range(self.config.cpu.world_size):
                kv = allocate_kv_cache(self.config.instance, rank, self.layout)
                self.kv.append(kv)
                self.registration_tokens[rank] = c.register_kv(rank, kv.registration())["token"]
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, timeout: float | None = None) -> Client:
        c = Client(self.config.connect_address("client"),
                   timeout=timeout or self.config.client.timeout_s,
                   curve=self.config.client.curve_keys())
        c.use_kv(self.registration_tokens)  # the engine's KV caches, registered at start
        self.clients.append(c)
        return c

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        self.node.stop()
        for kv in self.kv:
            kv.close()
        self.kv.clear()

    # -- the engine's side --------------------------------------------------------------

    def block_view(self, rank: int, gpu_block: int) -> np.ndarray:
        tensor = self.kv[rank].tensors[0]
        return tensor[gpu_block].view(-1).view(dtype=tensor.dtype).numpy().view(np.uint8)

    def fill(self, block_keys: list[bytes], gpu_blocks: list[int]) -> None:
        for rank in range(len(self.kv)):
            for key, block in zip(block_keys, gpu_blocks, strict=True):
                view = self.block_view(rank, block)
                view[:] = np.frombuffer(key_bytes(key, rank, view.size), dtype=np.uint8)

    def scramble(self, gpu_blocks: list[int]) -> None:
        for rank in range(len(self.kv)):
            for block in gpu_blocks:
                self.block_view(rank, block)[:] = 0xEE

    def holds(self, block_keys: list[bytes], gpu_blocks: list[int]) -> bool:
        return all(
            bytes(self.block_view(rank, b)) == key_bytes(k, rank, self.layout.page_size)
            for rank in range(len(self.kv))
            for k, b in zip(block_keys, gpu_blocks, strict=True)
        )


def wait_for(client: Client, job_ids: set[int], timeout: float = 10.0) -> dict[int, Any]:
    """Step until every job finished; returns job id -> result."""
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while job_ids - done.keys():
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs {sorted(job_ids - done.keys())} not finished in {timeout}s")
        step: Step = client.step()
        for result in step.finished:
            done[result.job_id] = result
        time.sleep(0.002)
    return done


def store_when_room(client: Client, keys: list[bytes], gpu_block_ids: list[int],
                    req_id: str | None = None, timeout: float = 10.0) -> Any:
    """Store, asking again while the broker refuses for want of room: blocks still
    being copied to a secondary tier are busy, and a refused store is all or nothing."""
    return step_until(client, lambda: _accepted(client.store(keys, gpu_block_ids, req_id)),
                      timeout)


def _accepted(store: Any) -> Any:
    return None if store.refused else store


def step_until(client: Client, predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        client.step()
        time.sleep(0.005)


def make_config(instance: str, run_dir: Path, **sections: Any) -> Config:
    data: dict[str, Any] = {
        "instance": instance,
        "run_dir": str(run_dir),
        "cpu": {"num_blocks": 16, "page_size": 1024, "world_size": 1},
        # One client may hold the whole (tiny) CPU tier: the tests that need two
        # clients' shares say so (`owner_share`).
        "broker": {"heartbeat_s": 0.5, "job_timeout_s": 10.0, "tick_ms": 2.0,
                   "drain_timeout_s": 3.0, "owner_share": 1.0},
        "client": {"timeout_s": 10.0},
        "supervisor": {"ready_timeout_s": 30.0, "stop_timeout_s": 10.0},
        "worker": {"device": "cpu"},
        "tiers": [{"type": "memory", "capacity_blocks": 256, "threads": 2}],
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(name), dict):
            data[name] = {**data[name], **value}
        else:
            data[name] = value
    return config_from_dict(data, "<test>")


def leftovers(run_dir: Path, instance: str) -> list[str]:
    found = [p.name for p in run_dir.glob("*.sock")] if run_dir.exists() else []
    found += [e for e in os.listdir("/dev/shm") if e.startswith(f"tierkv.{instance}")]
    return found
