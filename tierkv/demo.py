"""`tierkv demo`: a whole node on an embedded default, driven like an inference engine.

The node: the broker, a CPU worker, a disk tier in a temporary directory and an S3
tier on a local moto endpoint, all real processes started by the supervisor. The
engine: this process, with a KV cache far smaller than the working set, replaying
multi-turn conversations (built in, or a Mooncake trace with `--trace`). For each
request it looks up the prefix (waiting while blocks are promoted from disk or
S3), loads the hits into its KV cache, "recomputes" the rest, stores every block
and finishes the request. Every block it loads is checked against the bytes
derived from its key: end-to-end integrity, mismatches must be 0.

    tierkv demo                 # about a minute; report table, JSON and PNG in ./tierkv-demo
    tierkv demo --quick         # a short run (the test suite runs this)
    tierkv demo --trace conversation_trace.jsonl --requests 2000
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.client import Client, RemoteError
from tierkv.config import Config, ConfigError, config_from_dict, load_config
from tierkv.lifecycle import ChildFailed
from tierkv.logs import setup_logging
from tierkv.supervisor import EMBEDDED, Node
from tierkv.traces import Request, read_trace

log = logging.getLogger("tierkv.demo")

PAGE = 64 * 1024
GPU_BLOCKS = 512  # the engine's KV cache: far smaller than the working set
CONCURRENCY = 4  # requests the engine serves at once
MAX_PENDING_S = 2.0  # an engine would recompute rather than wait longer for promotions
MAX_STORE_RETRY_S = 5.0  # and drop an offload the CPU tier has had no room for
STEP_PAUSE_S = 0.005  # the engine's compute between steps
SAMPLE_EVERY = 20  # requests between points of the hit-ratio-over-time plot


def embedded_config(tmp: Path, quick: bool) -> Config:
    """The default node: small tiers, so that a minute of traffic reaches all three."""
    (tmp / "disk").mkdir(exist_ok=True)
    return config_from_dict({
        "instance": f"demo{os.getpid()}",
        "namespace": "demo-model/fp16",
        "run_dir": str(tmp / "run"),
        "log_level": "warning",
        "cpu": {"num_blocks": 320 if quick else 448, "page_size": PAGE},
        "broker": {"heartbeat_s": 1.0, "job_timeout_s": 30.0},
        "worker": {"device": "auto"},
        "tiers": [
            {"type": "disk", "name": "disk", "root": str(tmp / "disk"),
             "budget_bytes": (480 if quick else 1200) * (PAGE + 4096), "threads": 8},
            {"type": "s3", "name": "s3", "endpoint_url": EMBEDDED, "bucket": "tierkv-demo",
             "threads": 8, "negative_ttl_s": 5.0},
        ],
    }, "<embedded demo config>")


def demo_workload(n: int, seed: int) -> list[Request]:
    from tierkv.workload import generate_conversations

    return generate_conversations(
        n, seed=seed, conversations=20, turns=6.0, system_prompts=3, system_prompt_blocks=2,
        documents=16, document_share=0.6, document_blocks=(6, 20), first_blocks=(2, 6),
        turn_blocks=(1, 3), answer_blocks=(1, 2),
    )


# -- the engine -----------------------------------------------------------------------


def block_key(hash_id: int) -> bytes:
    return b"demo" + hash_id.to_bytes(8, "big")


def block_bytes(key: bytes, rank: int, size: int) -> np.ndarray:
    """The KV bytes of `key` on `rank`, derived from the key: any copy is checkable."""
    seed = int.from_bytes(hashlib.blake2b(key + bytes([rank]), digest_size=8).digest(), "big")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@dataclass
class Totals:
    requests: int = 0
    blocks: int = 0
    cpu_hits: int = 0  # hits at the first lookup: already in the CPU tier
    promoted_hits: int = 0  # hits that needed a promotion first
    recomputed: int = 0
    verified: int = 0
    mismatches: int = 0
    failed_jobs: int = 0
    gave_up_waiting: int = 0
    stores_refused: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    lookup_s: list[float] = field(default_factory=list)  # until answered, promotions included
    load_s: list[float] = field(default_factory=list)  # from issue to landed
    step_s: list[float] = field(default_factory=list)  # one batched round trip


class Phase(enum.Enum):
    LOOKUP = "lookup"  # asking, and asking again while blocks are promoted
    LOADING = "loading"  # hits on their way into the KV cache
    STORE_WAIT = "store_wait"  # the CPU tier had no room: offload again next step
    STORING = "storing"  # every block on its way to the CPU tier
    DONE = "done"


@dataclass(eq=False)
class Active:
    """One request the engine is serving."""

    index: int
    keys: list[bytes]
    gpu: list[int]
    started: float
    phase: Phase = Phase.LOOKUP
    first_hits: int | None = None
    hits: int = 0
    job: int | None = None
    job_started: float = 0.0

    @property
    def req_id(self) -> str:
        return f"req{self.index}"


class Engine:
    """Plays an inference engine: up to `concurrency` requests at once, and every
    engine step is one batched round trip (lookups, loads, stores, finishes, step)."""

    def __init__(self, config: Config, client: Client, gpu_blocks: int,
                 concurrency: int = CONCURRENCY) -> None:
        from tierkv.engine import KVLayout, allocate_kv_cache

        self.config = config
        self.client = client
        self.gpu_blocks = gpu_blocks
        self.concurrency = concurrency
        self.page = config.cpu.page_size
        # One uint8 tensor, blocks outermost, K and V halves: a page of exactly page_size.
        layout = KVLayout.blocks_outer(gpu_blocks, 1, 1, 1, self.page // 2, "uint8")
        self.kv = []
        try:
            for rank in range(config.cpu.world_size):
                self.kv.append(allocate_kv_cache(config.instance, rank, layout))
                client.register_kv(rank, self.kv[-1].registration())
        except BaseException:
            self.close()
            raise
        self._views = [kv.tensors[0].numpy().reshape(gpu_blocks, self.page) for kv in self.kv]
        self._free = list(range(gpu_blocks - 1, -1, -1))
        self._finished: dict[int, Any] = {}
        self.totals = Totals()

    def close(self) -> None:
        self._views = []
        for kv in self.kv:
            kv.close()

    def run(self, requests: list[Request], tick: Callable[[int], None], speedup: float) -> None:
        """Serve every request, each no earlier than its arrival time (the trace's
        timestamp, `speedup` times faster); `tick(n)` after each one completes."""
        waiting = list(enumerate(requests))
        waiting.reverse()
        active: list[Active] = []
        origin = requests[0].timestamp_ms if requests else 0.0
        start = time.perf_counter()
        while waiting or active:
            now = time.perf_counter() - start
            while waiting and len(active) < self.concurrency:
                index, request = waiting[-1]
                if (request.timestamp_ms - origin) / 1000 / speedup > now:
                    break  # not arrived yet
                keys = [block_key(h) for h in request.hash_ids][: self.gpu_blocks // 2]
                if len(keys) > len(self._free):
                    break  # the KV cache is full: wait for running requests to finish
                waiting.pop()
                gpu = [self._free.pop() for _ in keys]
                active.append(Active(index, keys, gpu, time.perf_counter()))
            self._step(active)
            done = [a for a in active if a.phase is Phase.DONE]
            for a in done:
                active.remove(a)
                self._free.extend(a.gpu)
                tick(1)

    # -- one engine step -------------------------------------------------------------

    def _step(self, active: list[Active]) -> None:
        batch = self.client.batch()
        asked: list[tuple[Active, str]] = []
        for a in active:
            if a.phase is Phase.LOOKUP:
                batch.lookup(a.keys, a.req_id)
                asked.append((a, "lookup"))
        batch.step()
        t0 = time.perf_counter()
        results = batch.send()
        self.totals.step_s.append(time.perf_counter() - t0)
        for result in results[-1].finished:
            self._finished[result.job_id] = result
        answered = [a for (a, _), found in zip(asked, results, strict=False)
                    if self._looked_up(a, found)]
        # Loads first: a store (or another request's promotion) may evict a hit
        # that has not been loaded yet, which an engine notices as a failed load.
        for a in answered:
            if a.hits:
                self._load(a)
        for a in answered:
            if a.phase is Phase.LOOKUP and not a.hits:
                self._compute_and_store(a)
        for a in active:
            if a.phase is Phase.STORE_WAIT:
                self._store(a)
        for a in active:
            if a.job is not None and a.job in self._finished:
                result = self._finished.pop(a.job)
                self.totals.failed_jobs += not result.success
                if a.phase is Phase.LOADING:
                    self._landed(a, result.success)
                else:
                    self._stored(a)
        if not self._views:
            return
        time.sleep(STEP_PAUSE_S)

    def _looked_up(self, a: Active, found: Any) -> bool:
        """Record a lookup's answer; True once the request stops asking."""
        if isinstance(found, Exception):
            raise found
        if a.first_hits is None:
            a.first_hits = found.hits
        waited = time.perf_counter() - a.started
        if found.pending and waited < MAX_PENDING_S:
            return False
        self.totals.gave_up_waiting += found.pending
        self.totals.lookup_s.append(waited)
        a.hits = found.hits
        return True

    def _load(self, a: Active) -> None:
        for block in a.gpu[: a.hits]:  # whatever was there must be overwritten
            for view in self._views:
                view[block] = 0
        try:
            load = self.client.load(a.keys[: a.hits], a.gpu[: a.hits], a.req_id)
        except RemoteError as e:
            if e.code != "bad_request":
                raise
            a.hits = 0  # evicted since the lookup: ask again
            self.totals.lookup_s.pop()
            return
        a.phase, a.job, a.job_started = Phase.LOADING, load.job_id, time.perf_counter()

    def _landed(self, a: Active, ok: bool) -> None:
        t = self.totals
        t.load_s.append(time.perf_counter() - a.job_started)
        if ok:
            t.bytes_loaded += a.hits * self.page * len(self._views)
            for key, block in zip(a.keys[: a.hits], a.gpu[: a.hits], strict=True):
                for rank, view in enumerate(self._views):
                    t.verified += 1
                    if not np.array_equal(view[block], block_bytes(key, rank, self.page)):
                        t.mismatches += 1
                        log.error("block %s on rank %d came back with wrong bytes", key.hex(),
                                  rank)
        else:
            a.hits = 0  # an engine recomputes what it could not load
        self._compute_and_store(a)

    def _compute_and_store(self, a: Active) -> None:
        for key, block in zip(a.keys[a.hits :], a.gpu[a.hits :], strict=True):
            for rank, view in enumerate(self._views):
                view[block] = block_bytes(key, rank, self.page)
        a.job_started = time.perf_counter()
        self._store(a)

    def _store(self, a: Active) -> None:
        """Offload the request's blocks; if the CPU tier has no room right now (its
        blocks are being loaded or cascaded), keep the GPU blocks and try again next
        step, for a while: that is the engine's backpressure."""
        store = self.client.store(a.keys, a.gpu, a.req_id)
        if store.refused and time.perf_counter() - a.job_started < MAX_STORE_RETRY_S:
            a.phase = Phase.STORE_WAIT
            return
        self.totals.stores_refused += store.refused
        self.totals.bytes_stored += len(store.keys_accepted) * self.page * len(self._views)
        if store.job_id is None:
            self._stored(a)
        else:
            a.phase, a.job = Phase.STORING, store.job_id

    def _stored(self, a: Active) -> None:
        self.client.finish(a.req_id)
        t = self.totals
        t.requests += 1
        t.blocks += len(a.keys)
        first = a.first_hits or 0
        t.cpu_hits += min(first, a.hits)
        t.promoted_hits += max(0, a.hits - first)
        t.recomputed += len(a.keys) - a.hits
        a.phase, a.job = Phase.DONE, None


# -- the run --------------------------------------------------------------------------


def run(config: Config, requests: list[Request], progress: bool,
        speedup: float) -> dict[str, Any]:
    from tqdm import tqdm

    node = Node(config)
    try:
        node.start()
    except ChildFailed as e:
        raise SystemExit(f"tierkv demo: the node did not start: {e}") from None
    engine = None
    try:
        client = Client.from_config(config)
        engine = Engine(config, client, GPU_BLOCKS)
        totals = engine.totals
        series: list[dict[str, Any]] = []
        start = time.perf_counter()
        last = _sample(client, totals, start)
        bar = tqdm(total=len(requests), unit="req", disable=not progress, dynamic_ncols=True,
                   desc="tierkv demo")

        def tick(n: int) -> None:
            nonlocal last
            bar.update(n)
            if totals.requests % SAMPLE_EVERY == 0 or totals.requests == len(requests):
                point = _sample(client, totals, start)
                series.append(_window(last, point))
                last = point
                bar.set_postfix_str(_postfix(series[-1], totals), refresh=False)

        engine.run(requests, tick, speedup)
        bar.close()
        elapsed = time.perf_counter() - start
        stats = client.stats()
        client.close()
        return _report(config, totals, stats, series, elapsed)
    finally:
        if engine is not None:
            engine.close()
        node.stop()


def _sample(client: Client, t: Totals, start: float) -> dict[str, Any]:
    stats = client.stats()
    return {
        "t": time.perf_counter() - start,
        "blocks": t.blocks,
        "cpu": t.cpu_hits,
        "tiers": {n: s.get("promoted_blocks", 0) for n, s in stats["tiers"].items()},
        "bytes": t.bytes_loaded + t.bytes_stored,
    }


def _window(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    blocks = max(1, b["blocks"] - a["blocks"])
    return {
        "t": b["t"],
        "hit_ratio": {"cpu": (b["cpu"] - a["cpu"]) / blocks,
                      **{n: (b["tiers"][n] - a["tiers"].get(n, 0)) / blocks for n in b["tiers"]}},
        "gbps": (b["bytes"] - a["bytes"]) / max(1e-9, b["t"] - a["t"]) / 1e9,
    }


def _postfix(point: dict[str, Any], t: Totals) -> str:
    ratios = " ".join(f"{n} {r:.0%}" for n, r in point["hit_ratio"].items())
    return f"hits {ratios} | {point['gbps']:.2f} GB/s | bad {t.mismatches}"


def _pct(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _report(config: Config, t: Totals, stats: dict[str, Any], series: list[dict[str, Any]],
            elapsed: float) -> dict[str, Any]:
    tiers = stats["tiers"]
    served = {"cpu": t.cpu_hits, **{n: s.get("promoted_blocks", 0) for n, s in tiers.items()}}
    moved = {
        "gpu<->cpu": {"store": t.bytes_stored, "load": t.bytes_loaded},
        **{n: {"store": s.get("bytes_stored", 0), "load": s.get("bytes_loaded", 0)}
           for n, s in tiers.items()},
    }
    return {
        "requests": t.requests,
        "blocks": t.blocks,
        "elapsed_s": elapsed,
        "served_blocks": served,
        "hit_blocks": t.cpu_hits + t.promoted_hits,
        "recomputed_blocks": t.recomputed,
        "hit_ratio": (t.cpu_hits + t.promoted_hits) / max(1, t.blocks),
        "bytes_moved": moved,
        "throughput_gbps": (t.bytes_loaded + t.bytes_stored) / max(elapsed, 1e-9) / 1e9,
        "latency_ms": {
            "lookup_p50": _pct(t.lookup_s, 0.5) * 1e3, "lookup_p99": _pct(t.lookup_s, 0.99) * 1e3,
            "load_p50": _pct(t.load_s, 0.5) * 1e3, "load_p99": _pct(t.load_s, 0.99) * 1e3,
            "step_p50": _pct(t.step_s, 0.5) * 1e3, "step_p99": _pct(t.step_s, 0.99) * 1e3,
        },
        "evictions": {"cpu": stats["cpu"]["evictions"],
                      **{n: s.get("evictions", 0) for n, s in tiers.items()}},
        "integrity": {"blocks_verified": t.verified, "mismatches": t.mismatches},
        "failed_jobs": t.failed_jobs,
        "gave_up_waiting": t.gave_up_waiting,
        "stores_refused": t.stores_refused,
        "page_size": config.cpu.page_size,
        "series": series,
    }


# -- output ---------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    total = max(1, report["blocks"])
    lines = [
        f"tierkv demo: {report['requests']} requests, {report['blocks']} blocks of "
        f"{report['page_size'] // 1024} KiB in {report['elapsed_s']:.1f}s",
        "",
        f"{'served from':<14}{'blocks':>10}{'share':>9}",
    ]
    for name, n in report["served_blocks"].items():
        lines.append(f"{name:<14}{n:>10}{n / total:>9.1%}")
    lines.append(f"{'recomputed':<14}{report['recomputed_blocks']:>10}"
                 f"{report['recomputed_blocks'] / total:>9.1%}")
    lines += ["", f"{'bytes moved':<14}{'store':>12}{'load':>12}"]
    for name, d in report["bytes_moved"].items():
        lines.append(f"{name:<14}{_mib(d['store']):>12}{_mib(d['load']):>12}")
    lat = report["latency_ms"]
    lines += [
        "",
        f"throughput     {report['throughput_gbps']:.3f} GB/s (GPU<->CPU, both directions)",
        f"lookup         p50 {lat['lookup_p50']:.2f} ms   p99 {lat['lookup_p99']:.2f} ms"
        "   (until answered, promotions included)",
        f"load           p50 {lat['load_p50']:.2f} ms   p99 {lat['load_p99']:.2f} ms",
        f"engine step    p50 {lat['step_p50']:.2f} ms   p99 {lat['step_p99']:.2f} ms"
        "   (one batched round trip)",
        "evictions      " + "  ".join(f"{n} {v}" for n, v in report["evictions"].items()),
        f"integrity      {report['integrity']['blocks_verified']} blocks verified, "
        f"{report['integrity']['mismatches']} mismatches",
        f"failed jobs    {report['failed_jobs']}   gave up waiting for promotions "
        f"{report['gave_up_waiting']}, for room to offload {report['stores_refused']}",
    ]
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    xs = [p["t"] for p in series]
    names = list(series[0]["hit_ratio"]) if series else []
    ax.stackplot(xs, *[[p["hit_ratio"][n] for p in series] for n in names], labels=names,
                 alpha=0.85)
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"hit ratio (blocks, windows of {SAMPLE_EVERY} requests)")
    ax.set_ylim(0, 1)
    ax.set_title(f"tierkv demo: hit ratio per tier (overall {report['hit_ratio']:.1%})")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierkv demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (~150 requests)")
    parser.add_argument("--requests", type=int, help="how many requests (default 900)")
    parser.add_argument("--trace", type=Path, help="a Mooncake-format trace to replay")
    parser.add_argument("-c", "--config", help="a node config instead of the embedded one")
    parser.add_argument("--out", type=Path, default=Path("tierkv-demo"),
                        help="where report.json and hit_ratio.png go (default ./tierkv-demo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speedup", type=float,
                        help="replay arrival times this much faster (default 15; 10 for a trace)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    setup_logging("demo", "warning")
    n = args.requests or (150 if args.quick else 900)
    if n < 1:
        parser.error("--requests must be positive")
    try:
        requests = read_trace(args.trace, limit=n) if args.trace else demo_workload(n, args.seed)
    except (OSError, ValueError) as e:
        print(f"tierkv demo: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tierkv-demo-") as tmp:
        try:
            config = load_config(args.config) if args.config else embedded_config(
                Path(tmp), args.quick)
        except ConfigError as e:
            print(f"tierkv demo: {e}", file=sys.stderr)
            return 2
        speedup = args.speedup or (10.0 if args.trace else 15.0)
        report = run(config, requests, not args.no_progress and sys.stderr.isatty(), speedup)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "hit_ratio.png")
    print(render(report))
    print(f"\nreport: {args.out / 'report.json'}   plot: {args.out / 'hit_ratio.png'}")
    ok = report["integrity"]["mismatches"] == 0 and report["failed_jobs"] == 0
    return 0 if ok else 1


__all__ = ["Engine", "Totals", "main"]
