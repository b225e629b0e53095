"""The demo's report: what the run measured, as a table, a JSON file and a plot.

One accounting runs through all three: every block a completed request needed was
either loaded, and counted once by where it came from (the CPU tier, or the
secondary tier a promotion brought it from, as the broker's load reply says), or
recomputed. The rows of "served from" therefore sum to the blocks, and the shares
to 100 %; the plot's windows use the same counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierkv.demo.engine import Totals
from tierkv.node.config import Config

SAMPLE_EVERY = 20  # completed requests per window of the plot, at least


def _pct(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def origins(config: Config, t: Totals) -> list[str]:
    """Where loaded blocks can come from, fastest first."""
    names = ["cpu", *config.tier_names]
    return names + [n for n in t.served if n not in names]


def build_report(config: Config, t: Totals, stats: dict[str, Any],
                 series: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    tiers = stats["tiers"]
    served = {name: t.served.get(name, 0) for name in origins(config, t)}
    loaded = sum(served.values())
    lookups = [s for samples in t.lookup_s.values() for s in samples]
    moved = {
        "gpu<->cpu": {"store": t.bytes_stored, "load": t.bytes_loaded},
        **{n: {"store": s.get("bytes_stored", 0), "load": s.get("bytes_loaded", 0)}
           for n, s in tiers.items()},
    }
    return {
        "requests": t.requests,
        "blocks": t.blocks,
        "elapsed_s": elapsed,
        "served_blocks": served,  # loaded, by origin; with recomputed: every block once
        "hit_blocks": loaded,
        "recomputed_blocks": t.recomputed,
        "hit_ratio": loaded / max(1, t.blocks),
        "bytes_moved": moved,
        "throughput_gbps": (t.bytes_loaded + t.bytes_stored) / max(elapsed, 1e-9) / 1e9,
        "latency_ms": {
            "lookup_p50": _pct(lookups, 0.5) * 1e3, "lookup_p99": _pct(lookups, 0.99) * 1e3,
            "load_p50": _pct(t.load_s, 0.5) * 1e3, "load_p99": _pct(t.load_s, 0.99) * 1e3,
            "step_p50": _pct(t.step_s, 0.5) * 1e3, "step_p99": _pct(t.step_s, 0.99) * 1e3,
        },
        "lookups": {kind: {"count": len(s), "p50_ms": _pct(s, 0.5) * 1e3}
                    for kind, s in t.lookup_s.items()},
        "evictions": {"cpu": stats["cpu"]["evictions"],
                      **{n: s.get("evictions", 0) for n, s in tiers.items()}},
        "integrity": {"blocks_verified": t.verified, "mismatches": t.mismatches},
        "failed_jobs": t.failed_jobs,
        "gave_up_waiting": t.gave_up_waiting,
        "stores_refused": t.stores_refused,
        "page_size": config.cpu.page_size,
        "window_requests": SAMPLE_EVERY,
        "series": series,
    }


def render(report: dict[str, Any]) -> str:
    total = max(1, report["blocks"])
    lat = report["latency_ms"]
    lines = [
        f"tierkv demo: {report['requests']} requests, {report['blocks']} blocks of "
        f"{report['page_size'] // 1024} KiB in {report['elapsed_s']:.1f}s",
        "",
        f"{'served from':<14}{'blocks':>10}{'share':>9}   (each block the requests needed, "
        "once)",
    ]
    for name, n in report["served_blocks"].items():
        lines.append(f"{name:<14}{n:>10}{n / total:>9.1%}")
    lines.append(f"{'recomputed':<14}{report['recomputed_blocks']:>10}"
                 f"{report['recomputed_blocks'] / total:>9.1%}")
    lines.append(f"{'total':<14}{report['blocks']:>10}{1 if report['blocks'] else 0:>9.1%}")
    lines += ["", f"{'bytes moved':<14}{'store':>12}{'load':>12}"]
    for name, d in report["bytes_moved"].items():
        lines.append(f"{name:<14}{_mib(d['store']):>12}{_mib(d['load']):>12}")
    kinds = report["lookups"]
    asked = sum(k["count"] for k in kinds.values())
    lines += [
        "",
        f"throughput     {report['throughput_gbps']:.3f} GB/s (GPU<->CPU, both directions)",
        f"lookup         p50 {lat['lookup_p50']:.2f} ms   p99 {lat['lookup_p99']:.2f} ms"
        f"   (admission until answered, waits included; {asked} requests)",
        *(f"  {kind + ':':<13}{k['count'] / max(1, asked):>4.0%}  p50 {k['p50_ms']:.2f} ms"
          for kind, k in kinds.items()),
        f"load           p50 {lat['load_p50']:.2f} ms   p99 {lat['load_p99']:.2f} ms"
        "   (issued until landed in the KV cache)",
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
    """One stacked bar per window, spanning the seconds the window covers: the share
    of its blocks served by each origin, and recomputed on top (so each bar is 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    names = list(report["served_blocks"])
    cmap = plt.get_cmap("tab10")
    colors = {name: cmap(i % 10) for i, name in enumerate(names)}
    for i, p in enumerate(series):
        bottom = 0.0
        width = max(p["t1"] - p["t0"], 1e-3)
        for name in names:
            share = p["served"].get(name, 0.0)
            ax.bar(p["t0"], share, width=width, bottom=bottom, align="edge", color=colors[name],
                   edgecolor="white", linewidth=0.4, label=name if i == 0 else None)
            bottom += share
        ax.bar(p["t0"], p["recomputed"], width=width, bottom=bottom, align="edge",
               color="#dddddd", edgecolor="white", linewidth=0.4,
               label="recomputed" if i == 0 else None)
    ax.set_xlabel(f"seconds since the first request (one bar per window of at least "
                  f"{report['window_requests']} completed requests)")
    ax.set_ylabel("share of the window's blocks, by where they came from")
    ax.set_ylim(0, 1)
    if series:
        ax.set_xlim(series[0]["t0"], series[-1]["t1"])
    ax.set_title(f"tierkv demo: blocks not recomputed, by tier (overall "
                 f"{report['hit_ratio']:.1%})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
