"""`tierkv bench vllm` (opt-in): tierkv inside vLLM 0.33, beside vLLM's own offloading.

    tierkv bench vllm [--quick] [--trace PATH]
    python -m tierkv.bench.vllm [--requests 256] [--steps 300] [--tierkv-hits]

Two figures, each against vLLM's own in-process back end in the same run:

* **Scheduler overhead**: vLLM's real `Scheduler` and offloading connector (scheduler
  side) at `--requests` running requests: the engine step's scheduler work
  (`schedule()` + `update_from_output()`) with tierkv behind it (a node: broker
  process, CPU tier) against the same steps with vLLM's `CPUOffloadingSpec` (its
  in-process `CPUOffloadingManager`), both with a CPU tier of the same size. The
  workload keeps `--requests` requests running: each a 512-token document prefix
  plus its own 64 tokens, decoding 16 to 64 tokens; one finished is replaced at
  once. Two workloads: one of 256 documents at random with room in the GPU for
  vLLM's own prefix cache (most repeats never reach the offloading tier), and one
  (`--tierkv-hits`) of 1.5x as many documents as requests, in turn, with no such
  room and a CPU tier that holds them all: a document's next request finds it in the
  offloading tier only, so its lookups, pins and loads are what is timed. Each row
  says how many prompt tokens the offloading tier served while timed. No forward pass and
  no copies: the step's transfers are reported done at once, for both back ends
  alike. The goal: at most 1.3x vLLM's step.
* **Hit ratio** (`tierkv.bench.vllm_hits`): tierkv's policies inside vLLM's own
  manager against vLLM's LRU, on the shared-prefix stream at 32 blocks and on the
  Mooncake conversation trace at 4000 blocks (goal: every policy at least vLLM's
  LRU, the best at least 1.7x on the trace).

Needs vLLM (`pip install 'tierkv[vllm]'`, or the environment `scripts/test` makes).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tierkv.bench.common import Options, Part, Row, Stat, ratio

OVERHEAD_GOAL = 1.3
DOCS = 256
DOC_TOKENS = 512
OWN_TOKENS = 64
CPU_BLOCKS = 4096


DOC_BLOCKS = DOC_TOKENS // 16


@dataclass(frozen=True)
class Workload:
    """`requests` running, each a document prefix (one of `docs`) and its own tokens.
    `gpu_cache_blocks`: GPU blocks beyond what the running requests need, vLLM's own
    prefix cache. `cycle`: documents in turn rather than at random."""

    requests: int = 256
    steps: int = 300
    warmup: int = 60
    seed: int = 0
    docs: int = DOCS
    gpu_cache_blocks: int = DOCS * 8
    cycle: bool = False
    cpu_blocks: int = CPU_BLOCKS

    def tierkv_hits(self) -> Workload:
        """Documents in turn, more of them than requests run at once, no spare GPU
        blocks and a CPU tier that holds them all: a document's next request finds
        it in the offloading tier only, so its hits are what is timed."""
        docs = self.requests + self.requests // 2
        return replace(self, docs=docs, gpu_cache_blocks=0, cycle=True,
                       cpu_blocks=max(CPU_BLOCKS, docs * DOC_BLOCKS * 5 // 4))


@dataclass
class Timed:
    """Scheduler seconds per timed step, and the prompt tokens the offloading tier
    served over those steps (vLLM's own counter)."""

    seconds: list[float]
    offloaded_hit_tokens: int


def step_times(make_extra: Callable[[Any], dict[str, Any]], workload: Workload,
               node: AbstractContextManager[Any]) -> Timed:
    """Scheduler work per engine step at `workload.requests` running."""
    from tierkv.bench.vllm_engine import Engine, EngineShape

    per_request = (DOC_TOKENS + OWN_TOKENS + 64) // 16 + 1
    shape = EngineShape(gpu_blocks=workload.requests * per_request + workload.gpu_cache_blocks,
                        max_num_seqs=workload.requests, max_batched_tokens=8192)
    rng = random.Random(workload.seed)
    docs = [[1000 + d * DOC_TOKENS + i for i in range(DOC_TOKENS)]
            for d in range(workload.docs)]
    with node as running:
        engine = Engine(shape, make_extra(running), copy=False, name="bench")
        try:
            serial = 0
            times: list[float] = []
            hits_before = 0
            for step in range(workload.warmup + workload.steps):
                while len(engine.scheduler.requests) < workload.requests:
                    serial += 1
                    own = [50_000 + serial * OWN_TOKENS + i for i in range(OWN_TOKENS)]
                    doc = docs[serial % len(docs)] if workload.cycle else rng.choice(docs)
                    engine.add(doc + own, max_tokens=rng.randint(16, 64))
                if step == workload.warmup:
                    hits_before = engine.tokens["external_hits"]
                engine.step()
                if step >= workload.warmup:
                    times.append(engine.step_seconds[-1])
            return Timed(times, engine.tokens["external_hits"] - hits_before)
        finally:
            engine.close()


def vllm_cpu_extra(cpu_blocks: int) -> Callable[[Any], dict[str, Any]]:
    from tierkv.bench.vllm_engine import EngineShape

    return lambda _node: {"spec_name": "CPUOffloadingSpec",
                          "cpu_bytes_to_use": cpu_blocks * EngineShape().page_size}


@dataclass
class Overhead:
    """Median step seconds per repeat, and offloaded hit tokens per repeat, for tierkv
    (`ours`) and vLLM's in-process CPU manager (`theirs`), run back to back."""

    ours: list[float]
    theirs: list[float]
    our_hits: list[int]
    their_hits: list[int]


def overhead(workload: Workload, repeats: int) -> Overhead:
    from tierkv.bench.vllm_engine import EngineShape, engine_node, tierkv_extra_config

    page = EngineShape().page_size
    out = Overhead([], [], [], [])
    for _ in range(repeats):
        theirs = step_times(vllm_cpu_extra(workload.cpu_blocks), workload, nullcontext())
        ours = step_times(tierkv_extra_config, workload,
                          engine_node(page, workload.cpu_blocks))
        out.theirs.append(statistics.median(theirs.seconds))
        out.ours.append(statistics.median(ours.seconds))
        out.their_hits.append(theirs.offloaded_hit_tokens)
        out.our_hits.append(ours.offloaded_hit_tokens)
    return out


def run(part: Part, opts: Options) -> None:
    base = Workload(requests=64 if opts.quick else 256, steps=40 if opts.quick else 300,
                    warmup=20 if opts.quick else 60)
    repeats = opts.pick(1, 3)
    for name, workload in (("repeats in vLLM's GPU cache", base),
                           ("repeats served by the offloading tier", base.tierkv_hits())):
        o = overhead(workload, repeats)
        times = statistics.median(o.ours) / statistics.median(o.theirs)
        # As every part: the reference's time over ours (1.0: as fast as in-process).
        part.add(Row("vllm", f"scheduler step, {workload.requests} running requests, {name}",
                     Stat.of(o.ours).scaled(1e3), "ms", "the same step with vLLM's "
                     "CPUOffloadingManager (in-process)", ratio(o.theirs, o.ours),
                     Stat.of(o.theirs).scaled(1e3),
                     note=f"median of {workload.steps} steps per repeat, {repeats} repeats; "
                          f"{times:.2f}x vLLM's step (goal <= {OVERHEAD_GOAL}x); offloaded "
                          f"hit tokens while timed: tierkv {statistics.median(o.our_hits):,.0f}"
                          f", vLLM {statistics.median(o.their_hits):,.0f}"))
        if part.over_budget("the next workload"):
            return
    hit_ratio_rows(part, opts)


def hit_ratio_rows(part: Part, opts: Options) -> None:
    from tierkv.bench.vllm_hits import (
        GOAL_BLOCKS,
        SHARED_PREFIX_BLOCKS,
        shared_prefix_stream,
    )
    from tierkv.workloads.traces import MOONCAKE_TRACE, read_trace

    stream = shared_prefix_stream()
    _hit_rows(part, stream, SHARED_PREFIX_BLOCKS, "shared-prefix stream", headline=False)
    trace = opts.trace or MOONCAKE_TRACE
    if not Path(trace).exists():
        part.skip(f"hit ratio: no trace at {trace}")
        return
    requests = read_trace(trace)
    if opts.quick:
        requests = requests[:2000]
    _hit_rows(part, requests, GOAL_BLOCKS, f"{len(requests):,} requests of {trace}")


def _hit_rows(part: Part, requests: list[Any], blocks: int, what: str,
              headline: bool = True) -> None:
    """Every policy inside vLLM's manager on `requests`, against vLLM's LRU."""
    from tierkv.bench.vllm_hits import baseline, best_in_vllm, hit_rows

    rows = hit_rows(requests, blocks, with_replay=False)
    base, best = baseline(rows), best_in_vllm(rows)
    assert base is not None and best is not None
    for row in rows:
        part.add(Row("vllm", f"hit ratio {blocks} blocks, {row.label}",
                     Stat.one(row.hit_ratio), "ratio", "vLLM lru in its CPUOffloadingManager",
                     Stat.one(row.hit_ratio / base.hit_ratio if base.hit_ratio else 0.0),
                     Stat.one(base.hit_ratio), headline=headline and row is best,
                     note=what))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tierkv-hits", action="store_true",
                        help="the workload whose repeats the offloading tier serves (no "
                             "room for vLLM's own prefix cache)")
    args = parser.parse_args(argv)
    workload = Workload(requests=args.requests, steps=args.steps)
    if args.tierkv_hits:
        workload = workload.tierkv_hits()
    o = overhead(workload, args.repeats)
    for name, values, hits in (("tierkv", o.ours, o.our_hits),
                               ("vLLM CPUOffloadingManager", o.theirs, o.their_hits)):
        print(f"{name:<28} median step {statistics.median(values) * 1e3:7.3f} ms "
              f"(repeats: {', '.join(f'{v * 1e3:.3f}' for v in values)}); offloaded hit "
              f"tokens while timed: {', '.join(f'{h:,}' for h in hits)}")
    print(f"ratio tierkv / vLLM: {statistics.median(o.ours) / statistics.median(o.theirs):.2f} "
          f"(goal <= {OVERHEAD_GOAL})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
