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
import hashlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.client import Client
from tierkv.config import Config, ConfigError, config_from_dict, load_config
from tierkv.lifecycle import ChildFailed
from tierkv.logs import setup_logging
from tierkv.supervisor import EMBEDDED, Node
from tierkv.traces import Request, read_trace

log = logging.getLogger("tierkv.demo")

PAGE = 64 * 1024
GPU_BLOCKS = 96  # the engine's KV cache: far smaller than the working set
MAX_PENDING_STEPS = 400  # an engine would recompute rather than wait longer
SAMPLE_EVERY = 20  # requests between points of the hit-ratio-over-time plot


def embedded_config(tmp: Path, quick: bool) -> Config:
    """The default node: small tiers, so that a minute of traffic reaches all three."""
    (tmp / "disk").mkdir(exist_ok=True)
    return config_from_dict({
        "instance": f"demo{os.getpid()}",
        "namespace": "demo-model/fp16",
        "run_dir": str(tmp / "run"),
        "log_level": "warning",
        "cpu": {"num_blocks": 160 if quick else 256, "page_size": PAGE},
        "broker": {"heartbeat_s": 1.0, "job_timeout_s": 30.0},
        "worker": {"device": "auto"},
        "tiers": [
            {"type": "disk", "name": "disk", "root": str(tmp / "disk"),
             "budget_bytes": (320 if quick else 768) * (PAGE + 4096), "threads": 4},
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
    bytes_loaded: int = 0
    bytes_stored: int = 0
    lookup_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)


class Engine:
    """Plays an inference engine against the node: one request at a time."""

    def __init__(self, config: Config, client: Client, gpu_blocks: int) -> None:
        from tierkv.engine import KVLayout, allocate_kv_cache

        self.config = config
        self.client = client
        self.gpu_blocks = gpu_blocks
        self.page = config.cpu.page_size
        # One uint8 tensor, blocks outermost, K and V halves: a page of exactly page_size.
        layout = KVLayout.blocks_outer(gpu_blocks, 1, 1, 1, self.page // 2, "uint8")
        self.kv = [allocate_kv_cache(config.instance, r, layout)
                   for r in range(config.cpu.world_size)]
        for rank, kv in enumerate(self.kv):
            client.register_kv(rank, kv.registration())
        self._views = [kv.tensors[0].numpy().reshape(gpu_blocks, self.page) for kv in self.kv]
        self._next_block = 0
        self.totals = Totals()

    def close(self) -> None:
        self._views = []
        for kv in self.kv:
            kv.close()

    def _gpu_blocks(self, n: int) -> list[int]:
        """The engine's block allocator: a ring, so blocks are reused round robin."""
        start = self._next_block
        self._next_block = (start + n) % self.gpu_blocks
        return [(start + i) % self.gpu_blocks for i in range(n)]

    def serve(self, index: int, request: Request) -> None:
        c, t = self.client, self.totals
        keys = [block_key(h) for h in request.hash_ids][: self.gpu_blocks]
        req_id = f"req{index}"
        t0 = time.perf_counter()
        found = c.lookup(keys, req_id)
        t.lookup_s.append(time.perf_counter() - t0)
        first_hits = found.hits
        steps = 0
        while found.pending and steps < MAX_PENDING_STEPS:
            c.step()
            time.sleep(0.001)
            found = c.lookup(keys, req_id)
            steps += 1
        t.gave_up_waiting += found.pending
        hits = found.hits
        gpu = self._gpu_blocks(len(keys))
        if hits:
            self._load(keys[:hits], gpu[:hits], req_id)
        for key, block in zip(keys[hits:], gpu[hits:], strict=True):
            for rank, view in enumerate(self._views):
                view[block] = block_bytes(key, rank, self.page)
        store = c.store(keys, gpu, req_id)
        if store.job_id is not None:
            result = c.wait([store.job_id])[store.job_id]
            t.failed_jobs += not result.success
            t.bytes_stored += len(store.keys_accepted) * self.page * len(self.kv)
        c.finish(req_id)
        t.requests += 1
        t.blocks += len(keys)
        t.cpu_hits += first_hits
        t.promoted_hits += hits - first_hits
        t.recomputed += len(keys) - hits

    def _load(self, keys: list[bytes], gpu: list[int], req_id: str) -> None:
        t = self.totals
        for block in gpu:  # whatever was there must be overwritten by the load
            for view in self._views:
                view[block] = 0
        t0 = time.perf_counter()
        load = self.client.load(keys, gpu, req_id)
        result = self.client.wait([load.job_id])[load.job_id]
        t.load_s.append(time.perf_counter() - t0)
        if not result.success:
            t.failed_jobs += 1
            return
        t.bytes_loaded += len(keys) * self.page * len(self.kv)
        for key, block in zip(keys, gpu, strict=True):
            for rank, view in enumerate(self._views):
                t.verified += 1
                if not np.array_equal(view[block], block_bytes(key, rank, self.page)):
                    t.mismatches += 1
                    log.error("block %s on rank %d came back with wrong bytes", key.hex(), rank)


# -- the run --------------------------------------------------------------------------


def run(config: Config, requests: list[Request], progress: bool) -> dict[str, Any]:
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
        series: list[dict[str, Any]] = []
        start = time.perf_counter()
        last = _sample(client, engine.totals, start)
        bar = tqdm(requests, unit="req", disable=not progress, dynamic_ncols=True,
                   desc="tierkv demo")
        for i, request in enumerate(bar):
            engine.serve(i, request)
            if (i + 1) % SAMPLE_EVERY == 0 or i + 1 == len(requests):
                point = _sample(client, engine.totals, start)
                series.append(_window(last, point))
                last = point
                bar.set_postfix_str(_postfix(series[-1], engine.totals, start), refresh=False)
        bar.close()
        elapsed = time.perf_counter() - start
        stats = client.stats()
        client.close()
        return _report(config, engine.totals, stats, series, elapsed)
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


def _postfix(point: dict[str, Any], t: Totals, start: float) -> str:
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
        },
        "evictions": {"cpu": stats["cpu"]["evictions"],
                      **{n: s.get("evictions", 0) for n, s in tiers.items()}},
        "integrity": {"blocks_verified": t.verified, "mismatches": t.mismatches},
        "failed_jobs": t.failed_jobs,
        "gave_up_waiting": t.gave_up_waiting,
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
        f"lookup         p50 {lat['lookup_p50']:.2f} ms   p99 {lat['lookup_p99']:.2f} ms",
        f"load           p50 {lat['load_p50']:.2f} ms   p99 {lat['load_p99']:.2f} ms",
        "evictions      " + "  ".join(f"{n} {v}" for n, v in report["evictions"].items()),
        f"integrity      {report['integrity']['blocks_verified']} blocks verified, "
        f"{report['integrity']['mismatches']} mismatches",
        f"failed jobs    {report['failed_jobs']}",
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
        report = run(config, requests, progress=not args.no_progress and sys.stderr.isatty())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "hit_ratio.png")
    print(render(report))
    print(f"\nreport: {args.out / 'report.json'}   plot: {args.out / 'hit_ratio.png'}")
    ok = report["integrity"]["mismatches"] == 0 and report["failed_jobs"] == 0
    return 0 if ok else 1


__all__ = ["Totals", "asdict", "main", "statistics"]
