"""The demo's report: what the run measured, as a table, a JSON file and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierkv.demo.engine import Totals
from tierkv.node.config import Config

SAMPLE_EVERY = 20  # requests between points of the hit-ratio-over-time plot


def _pct(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def build_report(config: Config, t: Totals, stats: dict[str, Any], series: list[dict[str, Any]],
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
