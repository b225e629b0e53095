#!/usr/bin/env python3
"""Policy figures: operations per second at 1e6 keys against a bare OrderedDict LRU,
and prefix hit ratios on the Mooncake trace when it is present.

    python -m tierkv.bench.policy_speed [--keys 1000000] [--ops 200000] [--trace PATH]

`bench_ops` and `OrderedDictLRU` are also what `tierkv bench policies` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from tierkv.core.policies import make_policy
from tierkv.core.primary import PrimaryTier
from tierkv.core.reuse import ReuseFilter
from tierkv.workloads.traces import MOONCAKE_TRACE, prefix_hit_ratio, read_trace

DEFAULT_TRACE = MOONCAKE_TRACE


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def timed(fn: Callable[[], None], ops: int, repeats: int,
          deadline: float | None = None) -> list[float]:
    """ops/s of each of `repeats` runs (fewer once `time.monotonic()` passes
    `deadline`; at least one)."""
    rates: list[float] = []
    for _ in range(repeats):
        if rates and deadline is not None and time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        fn()
        rates.append(ops / (time.perf_counter() - t0))
    return rates


class OrderedDictLRU:
    """The floor: a bare OrderedDict doing the same four operations."""

    def __init__(self) -> None:
        self.d: OrderedDict[bytes, int] = OrderedDict()

    def get(self, k: bytes) -> int | None:
        return self.d.get(k)

    def insert(self, k: bytes, v: int) -> None:
        self.d[k] = v

    def touch(self, keys: list[bytes]) -> None:
        for k in keys:
            self.d.move_to_end(k)

    def evict(self, n: int, protected) -> list[tuple[bytes, int]]:  # noqa: ANN001
        return [self.d.popitem(last=False) for _ in range(n)]


def bench_ops(policy, n_keys: int, n_ops: int, repeats: int,  # noqa: ANN001
              deadline: float | None = None) -> dict[str, list[float]]:
    """ops/s per repeat of lookup, touch and evict+insert, `n_keys` resident."""
    for i in range(n_keys):
        policy.insert(key(i), i)
    probe = [key((i * 7919) % n_keys) for i in range(n_ops)]
    fresh = iter(range(n_keys, n_keys + n_ops * repeats))
    empty: frozenset[bytes] = frozenset()

    def lookup() -> None:
        get = policy.get
        for k in probe:
            get(k)

    def touch() -> None:
        policy.touch(probe)

    def evict_insert() -> None:
        evict, insert = policy.evict, policy.insert
        for _ in range(n_ops):
            ((_, v),) = evict(1, empty)
            insert(key(next(fresh)), v)

    return {
        "lookup": timed(lookup, n_ops, repeats, deadline),
        "touch": timed(touch, n_ops, repeats, deadline),
        "evict+insert": timed(evict_insert, n_ops, repeats, deadline),
    }


def medians(runs: dict[str, list[float]]) -> dict[str, float]:
    return {op: statistics.median(rates) for op, rates in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacities", type=int, nargs="+", default=[1000, 4000, 16000])
    args = parser.parse_args(argv)

    print(f"policy operations at {args.keys:,} resident keys, {args.ops:,} ops, "
          f"median of {args.repeats} (ops/s, ratio to a bare OrderedDict LRU)")
    base = medians(bench_ops(OrderedDictLRU(), args.keys, args.ops, args.repeats))
    rows = {"OrderedDict": base}
    for name in ("lru", "arc"):
        rows[name] = medians(bench_ops(make_policy(name, args.keys), args.keys, args.ops,
                                       args.repeats))
    print(f"{'policy':<12}" + "".join(f"{op:>26}" for op in base))
    for name, r in rows.items():
        cells = "".join(f"{r[op]:>16,.0f} ({r[op] / base[op]:4.2f}x)" for op in base)
        print(f"{name:<12}{cells}")

    if not args.trace.exists():
        print(f"\ntrace {args.trace} not found: hit ratios skipped")
        return 0
    requests = read_trace(args.trace)
    print(f"\nprefix hit ratio on {args.trace.name} ({len(requests):,} requests)")
    variants = {
        "lru": lambda c: PrimaryTier(c, "lru"),
        "arc": lambda c: PrimaryTier(c, "arc"),
        "lru+reuse2": lambda c: PrimaryTier(c, "lru", reuse_filter=ReuseFilter(2)),
    }
    print(f"{'policy':<12}" + "".join(f"{c:>10}" for c in args.capacities))
    for name, make in variants.items():
        ratios = [prefix_hit_ratio(requests, make(c)) for c in args.capacities]
        print(f"{name:<12}" + "".join(f"{r:>10.4f}" for r in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
