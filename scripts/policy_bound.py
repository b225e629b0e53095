#!/usr/bin/env python3
"""How far can an online policy get? An upper bound for admission-based policies.

    python scripts/policy_bound.py [--trace PATH] [--capacities 1000 4000 16000]

Every online policy of tierkv (LRU, ARC, histarc, reuse filters) is, at heart, a
guess of *which* blocks will be used again, plus a recency order among those it
keeps. This script replays the trace with that guess made perfect: a block is
admitted into the CPU tier only if the trace names it again later (an oracle for
"does this conversation continue?", blind to *when*), and the admitted blocks are
ordered by LRU, ARC or histarc. What these reach is what a perfect predictor of
reuse would give each eviction order; an online policy only has a guess.
"""

from __future__ import annotations

import argparse
from collections.abc import Hashable, Sequence
from pathlib import Path

from tierkv.bench.belady import NEVER, belady, next_uses
from tierkv.bench.replay import DEFAULT_CAPACITIES, geometric_mean, replay
from tierkv.core.policies import make_policy
from tierkv.workloads.traces import read_trace

DEFAULT_TRACE = (Path(__file__).resolve().parents[1].parent
                 / "shared/data/mooncake-fast25/conversation_trace.jsonl")


def oracle_admission(requests: Sequence[Sequence[Hashable]], capacity: int,
                     policy_name: str) -> float:
    """Prefix hit ratio of `policy_name` when a block is stored only if it is used
    again (the oracle), as PrimaryTier would run it: hits touched, misses inserted."""
    requests = [list(dict.fromkeys(r)) for r in requests]
    policy = make_policy(policy_name, capacity)
    hits = total = 0
    for keys, uses in zip(requests, next_uses(requests), strict=True):
        total += len(keys)
        run = 0
        while run < len(keys) and policy.get(keys[run]) is not None:
            run += 1
        hits += run
        policy.touch([k for k in keys if policy.get(k) is not None])
        for key, use in zip(keys, uses, strict=True):
            if use == NEVER or policy.get(key) is not None:
                continue
            if len(policy) >= capacity and not policy.evict(1, frozenset(keys)):
                continue  # only the request's own blocks are left: not stored
            policy.insert(key, True)
    return hits / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacities", type=int, nargs="+", default=list(DEFAULT_CAPACITIES))
    args = parser.parse_args(argv)
    if not args.trace.exists():
        parser.error(f"no trace at {args.trace} (give --trace)")
    trace = read_trace(args.trace)
    requests = [r.hash_ids for r in trace]
    names = ["lru", "histarc", "oracle+lru", "oracle+arc", "oracle+histarc"]
    rows: dict[str, list[float]] = {name: [] for name in names}
    print(f"{'capacity':>8} {'belady':>7} " + " ".join(f"{n:>15}" for n in names))
    for capacity in args.capacities:
        optimum = belady(requests, capacity).hit_ratio
        measured = {name: replay(trace, capacity, name).hit_ratio if "+" not in name
                    else oracle_admission(requests, capacity, name.split("+")[1])
                    for name in names}
        for name, ratio in measured.items():
            rows[name].append(ratio / optimum)
        print(f"{capacity:>8} {optimum:>7.4f} " + " ".join(
            f"{measured[n]:.4f} ({measured[n] / optimum:.2f})".rjust(15) for n in names))
    print("geomean of fractions of Belady: " + ", ".join(
        f"{name} {geometric_mean(fr):.3f}" for name, fr in rows.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
