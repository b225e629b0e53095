"""`tierkv bench vllm` (opt-in): tierkv inside vLLM 0.33, beside vLLM's own offloading.

    tierkv bench vllm [--quick] [--trace PATH]
    python -m tierkv.bench.vllm [--requests 256] [--steps 300] [--trace PATH]

Two figures, each against vLLM's own in-process back end in the same run:

* **Scheduler overhead**: vLLM's real `Scheduler` and `OffloadingConnector` (scheduler
  side) at `--requests` running requests: the engine step's scheduler work
  (`schedule()` + `update_from_output()`) with tierkv behind it (a node: broker
  process, CPU tier) against the same steps with vLLM's `CPUOffloadingSpec` (its
  in-process `CPUOffloadingManager`), both with a CPU tier of the same size. The
  workload keeps `--requests` requests running: each a 512-token document prefix
  (one of 256, so the GPU prefix cache cannot hold them all and the offloading
  tier serves repeats) plus its own 64 tokens, decoding 16 to 64 tokens; one
  finished is replaced at once. No forward pass and no copies: the step's
  transfers are reported done at once, for both back ends alike. The goal: at most
  1.3x vLLM's step.
* **Hit ratio** (`tierkv.bench.vllm_hits`): on the Mooncake conversation trace with
  a CPU cache of 4000 blocks, tierkv's policies inside vLLM's own manager against
  vLLM's LRU (goal: the best at least 1.7x).

Needs vLLM (`pip install 'tierkv[vllm]'`, or the environment `scripts/test` makes).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.bench.common import Options, Part, Row, Stat, ratio

OVERHEAD_GOAL = 1.3
DOCS = 256
DOC_TOKENS = 512
OWN_TOKENS = 64
CPU_BLOCKS = 4096


@dataclass(frozen=True)
class Workload:
    requests: int = 256
    steps: int = 300
    warmup: int = 60
    seed: int = 0


def step_times(make_extra: Callable[[Any], dict[str, Any]], workload: Workload,
               node: AbstractContextManager[Any]) -> list[float]:
    """Seconds of scheduler work per engine step at `workload.requests` running."""
    from tierkv.bench.vllm_engine import Engine, EngineShape

    per_request = (DOC_TOKENS + OWN_TOKENS + 64) // 16 + 1
    shape = EngineShape(gpu_blocks=workload.requests * per_request + DOCS * 8,
                        max_num_seqs=workload.requests, max_batched_tokens=8192)
    rng = random.Random(workload.seed)
    docs = [[1000 + d * DOC_TOKENS + i for i in range(DOC_TOKENS)] for d in range(DOCS)]
    with node as running:
        engine = Engine(shape, make_extra(running), copy=False, name="bench")
        try:
            serial = 0
            times: list[float] = []
            for step in range(workload.warmup + workload.steps):
                while len(engine.scheduler.requests) < workload.requests:
                    serial += 1
                    own = [50_000 + serial * OWN_TOKENS + i for i in range(OWN_TOKENS)]
                    engine.add(rng.choice(docs) + own, max_tokens=rng.randint(16, 64))
                engine.step()
                if step >= workload.warmup:
                    times.append(engine.step_seconds[-1])
            return times
        finally:
            engine.close()


def vllm_cpu_extra(_node: Any) -> dict[str, Any]:
    from tierkv.bench.vllm_engine import EngineShape

    return {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": CPU_BLOCKS
            * EngineShape().page_size}


def overhead(workload: Workload, repeats: int) -> tuple[list[float], list[float]]:
    """Median step seconds per repeat: (tierkv, vLLM's CPU manager), back to back."""
    from tierkv.bench.vllm_engine import EngineShape, engine_node, tierkv_extra_config

    page = EngineShape().page_size
    ours, theirs = [], []
    for _ in range(repeats):
        theirs.append(statistics.median(step_times(vllm_cpu_extra, workload, nullcontext())))
        ours.append(statistics.median(step_times(
            tierkv_extra_config, workload, engine_node(page, CPU_BLOCKS))))
    return ours, theirs


def run(part: Part, opts: Options) -> None:
    workload = Workload(requests=64 if opts.quick else 256, steps=40 if opts.quick else 300,
                        warmup=20 if opts.quick else 60)
    repeats = opts.pick(1, 3)
    ours, theirs = overhead(workload, repeats)
    times = statistics.median(ours) / statistics.median(theirs)
    # As every part: the reference's time over ours (1.0: as fast as in-process).
    part.add(Row("vllm", f"scheduler step, {workload.requests} running requests",
                 Stat.of(ours).scaled(1e3), "ms", "the same step with vLLM's "
                 "CPUOffloadingManager (in-process)", ratio(theirs, ours),
                 Stat.of(theirs).scaled(1e3),
                 note=f"median of {workload.steps} steps per repeat, {repeats} repeats; "
                      f"{times:.2f}x vLLM's step (goal <= {OVERHEAD_GOAL}x)"))
    if part.over_budget("hit ratio on the trace"):
        return
    hit_ratio_rows(part, opts)


def hit_ratio_rows(part: Part, opts: Options) -> None:
    from tierkv.bench.vllm_hits import GOAL_BLOCKS, baseline, best_in_vllm, hit_rows
    from tierkv.workloads.traces import MOONCAKE_TRACE, read_trace

    trace = opts.trace or MOONCAKE_TRACE
    if not Path(trace).exists():
        part.skip(f"hit ratio: no trace at {trace}")
        return
    requests = read_trace(trace)
    if opts.quick:
        requests = requests[:2000]
    rows = hit_rows(requests, GOAL_BLOCKS, with_replay=False)
    base, best = baseline(rows), best_in_vllm(rows)
    assert base is not None and best is not None
    for row in rows:
        part.add(Row("vllm", f"hit ratio {GOAL_BLOCKS} blocks, {row.label}",
                     Stat.one(row.hit_ratio), "ratio", "vLLM lru in its CPUOffloadingManager",
                     Stat.one(row.hit_ratio / base.hit_ratio), Stat.one(base.hit_ratio),
                     headline=row is best, note=f"{len(requests):,} requests of {trace}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    workload = Workload(requests=args.requests, steps=args.steps)
    ours, theirs = overhead(workload, args.repeats)
    for name, values in (("tierkv", ours), ("vLLM CPUOffloadingManager", theirs)):
        print(f"{name:<28} median step {statistics.median(values) * 1e3:7.3f} ms "
              f"(repeats: {', '.join(f'{v * 1e3:.3f}' for v in values)})")
    print(f"ratio tierkv / vLLM: {statistics.median(ours) / statistics.median(theirs):.2f} "
          f"(goal <= {OVERHEAD_GOAL})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
