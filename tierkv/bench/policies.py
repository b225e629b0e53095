"""`tierkv bench policies`: the eviction policies' speed and hit ratios.

Hit ratio (`tierkv.bench.replay`): each policy replayed over the Mooncake conversation
trace through the real `PrimaryTier`, as a fraction of Belady's offline optimum
at each capacity; the headline per policy is the geometric mean of those
fractions. Speed (`tierkv/bench/policy_speed.py`'s `bench_ops`): lookup, touch and
evict+insert per second with 1e6 resident keys, against a bare `OrderedDict`
doing the same operations (the floor of any Python LRU).
"""

from __future__ import annotations

from pathlib import Path

from tierkv.bench.common import Options, Part, Row, Stat, ratio


def _speed(part: Part, opts: Options) -> None:
    from tierkv.bench.policy_speed import OrderedDictLRU, bench_ops
    from tierkv.core.policies import known_policies, make_policy
    from tierkv.node.config import CpuConfig

    repeats = opts.pick(2, 5)
    keys, ops = (10_000, 10_000) if opts.quick else (1_000_000, 200_000)
    part.note(f"policy speed: {keys:,} resident keys, {ops:,} ops per repeat, {repeats} repeats")
    base = bench_ops(OrderedDictLRU(), keys, ops, repeats)
    # Every registered policy (plug-ins included), the default first: a slow one
    # may use up the budget, and repeats stop early once it is spent.
    names = sorted(known_policies(), key=lambda name: name != CpuConfig.policy)
    for name in names:
        if part.over_budget(f"{name} speed"):
            return
        runs = bench_ops(make_policy(name, keys), keys, ops, repeats, part.budget.deadline())
        for op, rates in runs.items():
            part.add(Row("policies", f"{name} {op}", Stat.of(rates).scaled(1e-6), "M ops/s",
                         "OrderedDict LRU", ratio(rates, base[op], paired=False),
                         Stat.of(base[op]).scaled(1e-6), paired=False,
                         note="" if len(rates) == repeats else f"{len(rates)} of {repeats} "
                         "repeats: budget spent"))


def _hit_ratios(part: Part, opts: Options) -> None:
    from tierkv.bench.policy_speed import DEFAULT_TRACE
    from tierkv.bench.replay import (
        DEFAULT_CAPACITIES,
        DEFAULT_POLICIES,
        geometric_mean,
        policy_table,
    )
    from tierkv.workloads.traces import read_trace

    path: Path = opts.trace or DEFAULT_TRACE
    if not path.exists():
        part.note(f"trace {path} not found: hit ratios not measured")
        return
    limit, capacities = (300, (100, 400)) if opts.quick else (None, DEFAULT_CAPACITIES)
    requests = read_trace(path, limit)
    part.note(f"hit ratios on {path.name}: {len(requests):,} requests, "
              f"{sum(len(r.hash_ids) for r in requests):,} block lookups")
    fractions: dict[str, list[float]] = {p: [] for p in DEFAULT_POLICIES}
    for capacity in capacities:
        if part.over_budget(f"hit ratios at {capacity:,} blocks"):
            break
        table = policy_table(requests, [capacity], DEFAULT_POLICIES)
        (best,) = table.optimum
        for policy in DEFAULT_POLICIES:
            (result,), (fraction,) = table.rows[policy], table.fractions(policy)
            fractions[policy].append(fraction)
            part.add(Row("policies", f"{policy} hit ratio at {capacity:,} blocks",
                         Stat.one(result.hit_ratio), "", "Belady", Stat.one(fraction),
                         Stat.one(best.hit_ratio), headline=False))
    for policy, values in fractions.items():
        if values:
            part.add(Row("policies", f"{policy} hit ratio, geomean of {len(values)} capacities",
                         Stat.one(geometric_mean(values)), "x Belady", "Belady",
                         Stat.one(geometric_mean(values))))


def run(part: Part, opts: Options) -> None:
    # Hit ratios first: they are the policy table of the closing figures, and a
    # slow policy's speed run must not use up their budget.
    _hit_ratios(part, opts)
    if not part.over_budget("policy speed"):
        _speed(part, opts)
