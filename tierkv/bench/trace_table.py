#!/usr/bin/env python3
"""Policy figures: hit ratio and fraction of Belady's optimum per policy and capacity,
on the Mooncake conversation trace (when present) and on synthetic workloads of
different structure (tierkv.workloads.synthetic presets), so a policy that only fits one trace
shows it.

    python -m tierkv.bench.trace_table [--trace PATH] [--requests 6000] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tierkv.bench.replay import DEFAULT_CAPACITIES, DEFAULT_POLICIES, policy_table
from tierkv.workloads.synthetic import PRESETS, generate_workload
from tierkv.workloads.traces import MOONCAKE_TRACE, read_trace

DEFAULT_TRACE = MOONCAKE_TRACE


def trace_figures(path: Path, capacities: list[int], policies: list[str]) -> str:
    t0 = time.perf_counter()
    requests = read_trace(path)
    table = policy_table(requests, capacities, policies)
    title = (f"{path.name}: {len(requests):,} requests, "
             f"{sum(len(r.hash_ids) for r in requests):,} block lookups")
    return f"{table.format(title)}\n({time.perf_counter() - t0:.0f}s)"


def workload_figures(name: str, n_requests: int, seed: int, capacities: list[int],
                     policies: list[str]) -> str:
    t0 = time.perf_counter()
    requests = generate_workload(name, n_requests, seed=seed)
    table = policy_table(requests, capacities, policies)
    title = (f"synthetic '{name}' (seed {seed}): {len(requests):,} requests, "
             f"{sum(len(r.hash_ids) for r in requests):,} block lookups")
    return f"{table.format(title)}\n({time.perf_counter() - t0:.0f}s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacities", type=int, nargs="+", default=list(DEFAULT_CAPACITIES))
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument("--workloads", nargs="*", default=list(PRESETS),
                        help="synthetic presets to run (none: trace only)")
    parser.add_argument("--requests", type=int, default=6000, help="requests per workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    # Each table is independent: run them in parallel, print them in a fixed order.
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = []
        if args.trace.exists():
            futures.append(pool.submit(trace_figures, args.trace, args.capacities,
                                       args.policies))
        else:
            print(f"trace {args.trace} not found: trace figures skipped\n")
        futures += [pool.submit(workload_figures, name, args.requests, args.seed,
                                args.capacities, args.policies) for name in args.workloads]
        for future in futures:
            print(future.result(), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
