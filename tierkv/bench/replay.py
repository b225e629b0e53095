"""Trace replay: hit ratios of the CPU-tier policies, measured against Belady.

`replay` runs a trace through the real in-process `PrimaryTier` (the same code the
broker runs, with the replay rule of `tierkv.workloads.traces.prefix_hit_ratio`), so a
number here is what the service would do, not what a model of it would.
`policy_table` puts every policy next to the offline optimum of `tierkv.bench.belady` at
each capacity; the geometric mean of the fractions of Belady is the one figure
that ranks policies across cache sizes without letting one size dominate.
`main` is the `tierkv replay TRACE` command.

A policy is named as in the registry (`lru`, `arc`, `histarc`, ...), optionally
with `+reuse` or `+reuseN`: the policy behind a `ReuseFilter` of threshold N (2).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierkv.bench.belady import BeladyResult, belady
from tierkv.core.policies import make_policy
from tierkv.core.primary import PrimaryTier
from tierkv.core.reuse import ReuseFilter
from tierkv.workloads.traces import Request, prefix_hit_ratio, read_trace

DEFAULT_CAPACITIES = (1000, 4000, 16000)
DEFAULT_POLICIES = ("lru", "arc", "lru+reuse", "histarc")
_VARIANT = re.compile(r"^(?P<policy>[^+]+)(?:\+reuse(?P<threshold>\d*))?$")


@dataclass(frozen=True, slots=True)
class ReplayResult:
    policy: str
    capacity: int
    hit_blocks: int
    total_blocks: int
    evictions: int

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def replay(
    requests: Sequence[Request],
    capacity: int,
    policy_name: str,
    *,
    reuse_threshold: int | None = None,
    reuse_entries: int = 1 << 20,
) -> ReplayResult:
    """Replay `requests` against a `PrimaryTier` of `capacity` blocks.

    `policy_name` is a registered policy, or `NAME+reuse[N]` to put it behind a
    reuse filter; `reuse_threshold` does the same for a plain name."""
    policy, threshold = parse_policy(policy_name)
    if reuse_threshold is not None:
        threshold = reuse_threshold
    reuse = ReuseFilter(threshold, reuse_entries) if threshold is not None else None
    tier = PrimaryTier(capacity, make_policy(policy, capacity), reuse_filter=reuse,
                       enable_events=False)
    prefix_hit_ratio(requests, tier)
    # The tier's own counters are the replay's result: lookups count hit and
    # missed blocks exactly as prefix_hit_ratio does.
    stats = tier.stats()
    return ReplayResult(policy_name, capacity, stats["hits"], stats["hits"] + stats["misses"],
                        stats["evictions"])


def parse_policy(name: str) -> tuple[str, int | None]:
    """`"lru+reuse3"` -> `("lru", 3)`; `"arc"` -> `("arc", None)`."""
    match = _VARIANT.match(name)
    if match is None:
        raise ValueError(f"not a policy name: {name!r} (expected NAME or NAME+reuse[N])")
    threshold = match["threshold"]
    if threshold is None:
        return match["policy"], None
    return match["policy"], int(threshold) if threshold else 2


@dataclass(frozen=True, slots=True)
class PolicyTable:
    """Hit ratios per policy and capacity, with the Belady references.

    `optimum` is Belady with bypass (the true optimum, used for the fractions);
    `demand` is Belady that stores every block, the optimum of admit-all policies."""

    capacities: tuple[int, ...]
    rows: dict[str, tuple[ReplayResult, ...]]
    optimum: tuple[BeladyResult, ...]
    demand: tuple[BeladyResult, ...]

    def fractions(self, policy: str) -> list[float]:
        return [_fraction(r.hit_ratio, b.hit_ratio) for r, b in zip(self.rows[policy],
                                                                 self.optimum, strict=True)]

    def geomean(self, policy: str) -> float:
        return geometric_mean(self.fractions(policy))

    def format(self, title: str = "") -> str:
        head = f"{'policy':<14}" + "".join(f"{c:>16}" for c in self.capacities) + "   geomean"
        lines = [title] if title else []
        lines += [head, "-" * len(head)]
        for name, results in self.rows.items():
            cells = "".join(f"{r.hit_ratio:9.4f} ({f:4.2f})"
                            for r, f in zip(results, self.fractions(name), strict=True))
            lines.append(f"{name:<14}{cells}   {self.geomean(name):7.3f}")
        for label, refs in (("belady", self.optimum), ("belady-demand", self.demand)):
            cells = "".join(f"{b.hit_ratio:9.4f} ({_fraction(b.hit_ratio, o.hit_ratio):4.2f})"
                            for b, o in zip(refs, self.optimum, strict=True))
            lines.append(f"{label:<14}{cells}")
        lines.append("cells: hit ratio (fraction of Belady's with bypass); geomean of fractions")
        return "\n".join(lines)


def policy_table(
    requests: Sequence[Request],
    capacities: Sequence[int] = DEFAULT_CAPACITIES,
    policies: Sequence[str] = DEFAULT_POLICIES,
) -> PolicyTable:
    """Replay every policy at every capacity, and both Belady variants."""
    ids = [r.hash_ids for r in requests]
    rows = {name: tuple(replay(requests, c, name) for c in capacities) for name in policies}
    return PolicyTable(
        tuple(capacities),
        rows,
        tuple(belady(ids, c, bypass=True) for c in capacities),
        tuple(belady(ids, c, bypass=False) for c in capacities),
    )


def geometric_mean(values: Sequence[float]) -> float:
    if not values or any(v <= 0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _fraction(hit_ratio: float, optimum: float) -> float:
    return hit_ratio / optimum if optimum else 0.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierkv replay",
        description="Replay a Mooncake trace: policy hit ratios against Belady's optimum.")
    parser.add_argument("trace", type=Path, help="Mooncake-format JSONL trace")
    parser.add_argument("--capacities", type=int, nargs="+", default=list(DEFAULT_CAPACITIES),
                        help="CPU-tier sizes in blocks")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                        help="policy names; NAME+reuse[N] adds a reuse filter")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if any(c <= 0 for c in args.capacities):
        raise SystemExit("tierkv replay: capacities must be positive")
    for name in args.policies:
        try:
            make_policy(parse_policy(name)[0], 1)
        except ValueError as e:
            raise SystemExit(f"tierkv replay: {e}") from None
    requests = read_trace(args.trace, args.limit)
    table = policy_table(requests, args.capacities, args.policies)
    print(table.format(f"{args.trace.name}: {len(requests):,} requests, "
                       f"{sum(len(r.hash_ids) for r in requests):,} block lookups"))
    return 0
