#!/usr/bin/env python3
"""Broker figures: control-plane round trips against the in-process manager, and
the data path through the CPU worker against a plain numpy copy of the same bytes.

    python -m tierkv.bench.broker_ops [--rounds 2000] [--blocks 1000] [--page-kib 256]

Control plane: p50/p99 of a `lookup` of 64 keys and of one batched step of
256 requests x 64 keys (once missing at the first key, once hitting all 64: only
then does a lookup walk every key), and keys/s through lookup, each against the
same calls on an in-process `TieringManager` holding the same blocks (ratio =
in-process time / broker time: the share of the ideal a service reaches). Data
path: store then load of `--blocks` blocks of `--page-kib` KiB through broker +
worker, GB/s against `np.copyto` of the same total bytes in the same run. Medians
of repeats.

The measuring functions (`bench_node`, `control_plane`, `data_path`) are also what
`tierkv bench control` and `tierkv bench datapath` run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from tierkv.client import Client
from tierkv.core.primary import PrimaryTier
from tierkv.core.tiering import TieringManager
from tierkv.engine import KVCache, KVLayout, allocate_kv_cache
from tierkv.node.config import Config, CpuConfig, config_from_dict
from tierkv.node.supervisor import Node
from tierkv.wire.protocol import encode

KEYS_PER_REQUEST = 64
REQUESTS_PER_STEP = 256
STEPS = ("step_miss", "step_hit")

# Samples of one call, one list per repeat: (broker, in-process).
Runs = tuple[list[list[float]], list[list[float]]]


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def timed(fn: Callable[[], Any], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def node_config(instance: str, run_dir: Path, blocks: int, page: int,
                policy: str | None = None, realtime: int = 0) -> Config:
    cpu: dict[str, Any] = {"num_blocks": max(blocks, REQUESTS_PER_STEP * 2), "page_size": page}
    if policy is not None:
        cpu["policy"] = policy
    return config_from_dict({
        "instance": instance, "run_dir": str(run_dir), "log_level": "warning",
        "cpu": cpu,
        "worker": {"device": "cpu"},
        "broker": {"job_timeout_s": 120.0, "heartbeat_s": 1.0, "realtime_priority": realtime},
        "client": {"timeout_s": 120.0, "realtime_priority": realtime},
    }, "<bench>")


def layout_for(page: int, blocks: int) -> KVLayout:
    # 32 layers, K and V, 16-token blocks of fp16: heads x head_dim fills the page.
    per_token = page // (32 * 2 * 16 * 2)
    head_dim = 128 if per_token % 128 == 0 else per_token
    return KVLayout.per_layer(32, blocks, 16, per_token // head_dim, head_dim, "float16")


@contextmanager
def bench_node(blocks: int, page: int, kv_blocks: int | None = None,
               policy: str | None = None, realtime: int = 0) -> Iterator[tuple[Client, KVCache]]:
    """A node (broker + CPU worker) of at least `blocks` blocks of `page` bytes
    (under `policy`, default the config's; broker and client at `realtime_priority`
    `realtime`),
    with a CPU KV cache of `kv_blocks` (default `blocks`) blocks registered for
    rank 0; stopped and removed on exit."""
    instance = f"bench{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        config = node_config(instance, Path(tmp), blocks, page, policy, realtime)
        node = Node(config)
        node.start()
        try:
            kv = allocate_kv_cache(instance, 0, layout_for(page, kv_blocks or blocks))
            try:
                client = Client.from_config(config)
                try:
                    client.register_kv(0, kv.registration())
                    kv.tensors[0].view(-1)[:] = 1
                    yield client, kv
                finally:
                    client.close()
            finally:
                kv.close()
        finally:
            node.stop()


def control_plane(client: Client, rounds: int, repeats: int = 1) -> dict[str, Runs]:
    """Lookup of 64 hot keys, and one batched step of 256 requests x 64 keys that
    miss at the first key (`step_miss`) or hit all 64 (`step_hit`), each on the
    broker and on an in-process manager holding the same blocks. The `rounds` are
    split into `repeats`, broker and in-process back to back in each."""
    hot = store_hot(client)
    # The node's default policy on both sides (what a user of either gets).
    manager = TieringManager(PrimaryTier(4096, CpuConfig().policy))
    out = manager.prepare_store(hot)
    assert out is not None
    manager.complete_store(out.keys_to_store)

    cold = [[key(10_000 + r * KEYS_PER_REQUEST + i) for i in range(KEYS_PER_REQUEST)]
            for r in range(REQUESTS_PER_STEP)]
    steps = {"step_miss": cold, "step_hit": [hot] * REQUESTS_PER_STEP}

    def remote_step(requests: list[list[bytes]]) -> Callable[[], None]:
        def run() -> None:
            batch = client.batch()
            for r, keys in enumerate(requests):
                batch.lookup(keys, f"r{r}")
            batch.step().send()
        return run

    def local_step(requests: list[list[bytes]]) -> Callable[[], None]:
        def run() -> None:
            for r, keys in enumerate(requests):
                manager.lookup(keys, f"r{r}")
            manager.step()
        return run

    calls: dict[str, tuple[Callable[[], Any], Callable[[], Any], int]] = {
        "lookup": (lambda: client.lookup(hot, "bench"), lambda: manager.lookup(hot, "bench"),
                   max(1, rounds // repeats)),
    }
    step_rounds = max(2, max(10, rounds // 40) // repeats)
    for name, requests in steps.items():
        calls[name] = (remote_step(requests), local_step(requests), step_rounds)
    results: dict[str, Runs] = {name: ([], []) for name in calls}
    payload = encode(client.batch().lookup(hot, "bench").request(1))
    results["zmq"] = ([], [])
    with echo_server() as address:
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)

        def raw() -> None:
            sock.send(payload)
            sock.recv()

        try:
            timed(raw, 200)  # connected and warm
            for _ in range(repeats):
                for name, (remote, local, n) in calls.items():
                    results[name][0].append(timed(remote, n))
                    results[name][1].append(timed(local, n))
                results["zmq"][0].append(timed(raw, calls["lookup"][2]))
        finally:
            sock.close()
    # The hits above are leased to their requests: end them, or the leased blocks
    # stay pinned and a later store of a full tier (data_path) is refused.
    done = client.batch()
    for req_id in ["bench", *(f"r{r}" for r in range(REQUESTS_PER_STEP))]:
        done.finish(req_id)
    done.send()
    return results


def store_hot(client: Client) -> list[bytes]:
    """A stored prefix, so that lookups walk real hits (64 keys, all in the CPU tier)."""
    hot = [key(i) for i in range(KEYS_PER_REQUEST)]
    store = client.store(hot, list(range(KEYS_PER_REQUEST)))
    _wait(client, {store.job_id})
    return hot


# A busy process of the host: in the normal class whatever its parent's (the bench's
# thread may be in SCHED_RR while it waits for the broker).
HOG = ("import os\n"
       "os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))\n"
       "while True: pass")


def loaded_tail(client: Client, rounds: int, hogs: int) -> tuple[list[float], list[float]]:
    """A 64-key lookup's round trips (of the keys `store_hot` stored), on a quiet
    machine and then with `hogs` busy processes beside it (each a Python loop that
    never sleeps): the tail a loaded engine host gives the control plane."""
    hot = [key(i) for i in range(KEYS_PER_REQUEST)]
    quiet = timed(lambda: client.lookup(hot, "tail"), rounds)
    busy = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        time.sleep(0.2)  # let them take their share
        loaded = timed(lambda: client.lookup(hot, "tail"), rounds)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait(5)
    client.batch().finish("tail").send()
    return quiet, loaded


ECHO = """
import sys, zmq
sock = zmq.Context.instance().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("ready", flush=True)
while True:
    frames = sock.recv_multipart()
    if frames[-1] == b"stop":
        break
    sock.send_multipart(frames)
"""


@contextmanager
def echo_server() -> Iterator[str]:
    """A ROUTER in its own process that sends every message straight back: the raw
    ZeroMQ round trip a request to the broker can at best match."""
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/echo.sock"
        proc = subprocess.Popen([sys.executable, "-c", ECHO, address],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().startswith("ready")
            yield address
        finally:
            stopper: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
            stopper.setsockopt(zmq.LINGER, 0)
            stopper.connect(address)
            stopper.send(b"stop")
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            stopper.close()


def data_path(client: Client, kv: Any, blocks: int, page: int, repeats: int) -> dict[str, Any]:
    """Seconds per repeat to store then load `blocks` blocks through broker + worker,
    and for two plain copies of the same bytes, back to back: one `np.copyto` of it
    all, and the same bytes in the pieces of the KV layout (a chunked memcpy: what a
    copy engine must do at best, piece by piece, for this layout)."""
    nbytes = blocks * page
    pieces = _pieces(kv.layout)
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)  # fault its pages in now, not in the first timed copy
    # The layout's pieces: (pieces per block, blocks, piece bytes) on the KV side,
    # (blocks, pieces per block, piece bytes) on the CPU tier's.
    kv_side = src.reshape(pieces, blocks, page // pieces)
    tier_side = dst.reshape(blocks, pieces, page // pieces)
    stores, loads, copies, chunked = [], [], [], []
    for rep in range(repeats):
        keys = [key(1_000_000 + rep * blocks + i) for i in range(blocks)]
        t0 = time.perf_counter()
        store = client.store(keys, list(range(blocks)))
        _wait(client, {store.job_id})
        stores.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        load = client.load(keys, list(range(blocks)))
        _wait(client, {load.job_id})
        loads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(tier_side, kv_side.transpose(1, 0, 2))
        chunked.append(time.perf_counter() - t0)
    return {"store": stores, "load": loads, "memcpy": copies, "chunked": chunked,
            "bytes": nbytes, "piece": page // pieces}


def _pieces(layout: Any) -> int:
    """How many pieces one block is in the KV cache (per tensor: its `outer`)."""
    return sum(layout.geometry(i)[0] for i in range(len(layout.tensor_shapes)))


def _wait(client: Client, jobs: set[int | None]) -> None:
    """Until the jobs finished: the broker answers when they have (no polling)."""
    if None in jobs:  # a store with nothing accepted: waiting would never end
        raise RuntimeError("the broker accepted no keys of a store (refused: no room)")
    for result in client.wait(list(jobs)).values():
        if not result.success:
            raise RuntimeError(f"job {result.job_id} failed: {result.error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    page = args.page_kib * 1024
    with bench_node(args.blocks, page) as (client, kv):
        cp = control_plane(client, args.rounds)
        dp = data_path(client, kv, args.blocks, page, args.repeats)
    report(cp, dp, args, page)
    return 0


def _flat(runs: list[list[float]]) -> list[float]:
    return [s for run in runs for s in run]


def report(cp: dict[str, Runs], dp: dict[str, Any], args: argparse.Namespace,
           page: int) -> None:
    print("control plane (broker round trip vs in-process TieringManager, same calls)")
    print(f"{'call':<40}{'broker p50':>12}{'p99':>10}{'in-proc p50':>13}{'p99':>10}"
          f"{'ratio p50':>11}")
    labels = {
        "lookup": f"lookup {KEYS_PER_REQUEST} keys",
        "step_miss": f"step {REQUESTS_PER_STEP} req x {KEYS_PER_REQUEST} keys, misses",
        "step_hit": f"step {REQUESTS_PER_STEP} req x {KEYS_PER_REQUEST} keys, hits",
    }
    for name, label in labels.items():
        remote, local = cp[name]
        r50, r99 = percentiles(_flat(remote))
        l50, l99 = percentiles(_flat(local))
        print(f"{label:<40}{r50 * 1e6:>10.0f}us{r99 * 1e6:>8.0f}us{l50 * 1e6:>11.0f}us"
              f"{l99 * 1e6:>8.0f}us{l50 / r50:>11.3f}")
    r50, _ = percentiles(_flat(cp["step_hit"][0]))
    l50, _ = percentiles(_flat(cp["step_hit"][1]))
    keys = REQUESTS_PER_STEP * KEYS_PER_REQUEST
    print(f"keys/s through lookup (batched, all hits): broker {keys / r50:,.0f}, in-process "
          f"{keys / l50:,.0f} (ratio {l50 / r50:.3f})")
    print()
    print(f"data path: {args.blocks} blocks x {page // 1024} KiB through broker + CPU worker "
          f"vs np.copyto of the same bytes; median of {args.repeats} (min-max), GB/s")
    nbytes = dp["bytes"]
    memcpy = statistics.median(nbytes / s for s in dp["memcpy"]) / 1e9
    for name in ("store", "load"):
        gbps = [nbytes / s / 1e9 for s in dp[name]]
        med = statistics.median(gbps)
        print(f"  {name:<6}{med:>7.2f} ({min(gbps):.2f}-{max(gbps):.2f})   memcpy "
              f"{memcpy:.2f}   ratio {med / memcpy:.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
