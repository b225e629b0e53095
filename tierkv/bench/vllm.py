"""`tierkv bench vllm` (opt-in): tierkv inside vLLM 0.33, beside vLLM's own offloading.

    tierkv bench vllm [--quick] [--trace PATH]
    python -m tierkv.bench.vllm [--requests 256] [--steps 300] [--tierkv-hits] [--queued N]

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
  says how many prompt tokens the offloading tier served while timed, and how many
  prompt tokens were admitted per step (requests first running). A third workload
  is the second with a quarter of the requests waiting in vLLM's queue (the engine
  runs the rest at most), as on a loaded server: vLLM scans a queued request only
  once a running one makes room, steps after it was added. No forward pass and
  no copies: the step's transfers are reported done at once, for both back ends
  alike. The goal: at most 1.0x vLLM's step, and no more than LMCache MP's.
* **LMCache 0.5.6 MP beside it**, where the peers' environment exists (`python -m
  tierkv.bench.peers.env` builds it; this never does): the same workloads with
  vLLM's `LMCacheMPConnector` and an LMCache cache server process
  (`tierkv.bench.peers.drivers.lmcache_step`, run in that environment). Its
  lookups are answered asynchronously, so besides its step it says how many prompt
  tokens it admitted per step and how many its tier served.
* **Hit ratio** (`tierkv.bench.vllm_hits`): tierkv's policies inside vLLM's own
  manager against vLLM's LRU, on the shared-prefix stream at 32 blocks and on the
  Mooncake conversation trace at 4000 blocks (goal: every policy at least vLLM's
  LRU, the best at least 1.7x on the trace).

Needs vLLM (`pip install 'tierkv[vllm]'`, or the environment `scripts/test` makes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tierkv.bench.common import Options, Part, Row, Stat, ratio
from tierkv.bench.vllm_methods import MethodTimes, paired, report

OVERHEAD_GOAL = 1.0
ANSWERED_GOAL = 0.95
DOCS = 256
DOC_TOKENS = 512
OWN_TOKENS = 64
CPU_BLOCKS = 4096


DOC_BLOCKS = DOC_TOKENS // 16


@dataclass(frozen=True)
class Workload:
    """`requests` running, each a document prefix (one of `docs`) and its own tokens.
    `gpu_cache_blocks`: GPU blocks beyond what the running requests need, vLLM's own
    prefix cache. `cycle`: documents in turn rather than at random. `queued`: of the
    `requests`, how many wait in vLLM's queue (the engine runs the others at most):
    a loaded server's, where vLLM scans a request only once one running makes room."""

    requests: int = 256
    steps: int = 300
    warmup: int = 60
    seed: int = 0
    docs: int = DOCS
    gpu_cache_blocks: int = DOCS * 8
    cycle: bool = False
    cpu_blocks: int = CPU_BLOCKS
    queued: int = 0

    def tierkv_hits(self) -> Workload:
        """Documents in turn, more of them than requests run at once, no spare GPU
        blocks and a CPU tier that holds them all: a document's next request finds
        it in the offloading tier only, so its hits are what is timed."""
        docs = self.requests + self.requests // 2
        return replace(self, docs=docs, gpu_cache_blocks=0, cycle=True,
                       cpu_blocks=max(CPU_BLOCKS, docs * DOC_BLOCKS * 5 // 4))


@dataclass
class Timed:
    """Scheduler seconds per timed step, the prompt tokens the offloading tier
    served over those steps (vLLM's own counter), and the prompt tokens of the
    requests admitted (first running) over them: a back end that makes requests
    wait for its answers admits fewer."""

    seconds: list[float]
    offloaded_hit_tokens: int
    admitted_tokens: int = 0
    # Of the requests first asked about while timed, the share the back end answered
    # in that step (vLLM's connector did not defer them to a later step).
    answered_first: float = 0.0
    # Per timed step, the seconds of vLLM's `add_request` for the requests added just
    # before it: the back end's hook runs there, on the engine's thread as the step.
    add_seconds: list[float] = field(default_factory=list)

    def with_adds(self) -> list[float]:
        return [s + a for s, a in zip(self.seconds, self.add_seconds, strict=True)]


def step_times(make_extra: Callable[[Any], dict[str, Any]], workload: Workload,
               node: AbstractContextManager[Any], make_engine: Callable[..., Any] | None = None,
               methods: MethodTimes | None = None,
               before_timed: Callable[[], None] | None = None,
               after_timed: Callable[[Timed], None] | None = None) -> Timed:
    """Scheduler work per engine step at `workload.requests` running. `make_engine`:
    the harness's `Engine` (scheduler side only) unless a peer's driver brings its own
    (same signature). `methods`: the manager's calls timed into it while timed.
    `before_timed` is called once the warm-up is done, before the first timed step's
    requests are added, and `after_timed` with the result before the engine is
    closed: several engine processes on one node line their timed windows up there
    (`tierkv.bench.engines`)."""
    from tierkv.bench.vllm_engine import Engine, EngineShape

    make_engine = make_engine or Engine

    per_request = (DOC_TOKENS + OWN_TOKENS + 64) // 16 + 1
    shape = EngineShape(gpu_blocks=workload.requests * per_request + workload.gpu_cache_blocks,
                        max_num_seqs=workload.requests - workload.queued,
                        max_batched_tokens=8192)
    rng = random.Random(workload.seed)
    docs = [[1000 + d * DOC_TOKENS + i for i in range(DOC_TOKENS)]
            for d in range(workload.docs)]
    with node as running:
        engine = make_engine(shape, make_extra(running), copy=False, name="bench")
        _freeze_startup_heap()
        first = _first_answers(engine.scheduler.connector)
        adding = _add_seconds(engine.scheduler)
        if methods is not None:
            scheduler_side: Any = engine.scheduler.connector
            methods.attach(scheduler_side.connector_scheduler.manager)
        try:
            serial = 0
            times: list[float] = []
            adds: list[float] = []
            hits_before = admitted = 0
            started: set[str] = set()
            for step in range(workload.warmup + workload.steps):
                if step == workload.warmup and before_timed is not None:
                    before_timed()
                while len(engine.scheduler.requests) < workload.requests:
                    serial += 1
                    own = [50_000 + serial * OWN_TOKENS + i for i in range(OWN_TOKENS)]
                    doc = docs[serial % len(docs)] if workload.cycle else rng.choice(docs)
                    engine.add(doc + own, max_tokens=rng.randint(16, 64))
                if step == workload.warmup:
                    hits_before = engine.tokens["external_hits"]
                    first.clear()
                    if methods is not None:
                        methods.counting = True
                timing = methods if methods is not None and methods.counting else None
                if timing is not None:
                    timing.begin_step()
                engine.step()
                if timing is not None:
                    timing.end_step()
                # Outside the timed calls: which requests run for the first time.
                for req in engine.scheduler.running:
                    if req.request_id not in started:
                        started.add(req.request_id)
                        if step >= workload.warmup:
                            admitted += req.num_prompt_tokens
                if step >= workload.warmup:
                    times.append(engine.step_seconds[-1])
                    adds.append(adding[0])
                adding[0] = 0.0
            if methods is not None:
                methods.counting = False
            answered = sum(first.values()) / len(first) if first else 0.0
            timed = Timed(times, engine.tokens["external_hits"] - hits_before, admitted,
                          answered, adds)
            if after_timed is not None:
                after_timed(timed)
            return timed
        finally:
            engine.close()
            gc.unfreeze()


def _freeze_startup_heap() -> None:
    """What vLLM's engine core does once it is built (`freeze_gc_heap`): everything
    alive now is left out of the collector's passes, so its full collections walk
    only what the steps made, as in a served engine."""
    gc.collect()
    gc.freeze()


def _first_answers(connector: Any) -> dict[str, bool]:
    """Per request, whether vLLM's first ask about it was answered (not deferred to
    a later step), filled as the scheduler asks (both back ends pay the same wrap)."""
    first: dict[str, bool] = {}
    ask = connector.get_num_new_matched_tokens

    def asked(request: Any, *args: Any, **kwargs: Any) -> Any:
        result = ask(request, *args, **kwargs)
        first.setdefault(request.request_id, result[0] is not None)
        return result

    connector.get_num_new_matched_tokens = asked
    return first


def _add_seconds(scheduler: Any) -> list[float]:
    """vLLM's `add_request` timed (both back ends pay the same wrap): the seconds
    since the list's one item was last set to 0."""
    spent = [0.0]
    add = scheduler.add_request

    def timed(request: Any) -> Any:
        start = time.perf_counter()
        try:
            return add(request)
        finally:
            spent[0] += time.perf_counter() - start

    scheduler.add_request = timed
    return spent


def vllm_cpu_extra(cpu_blocks: int) -> Callable[[Any], dict[str, Any]]:
    from tierkv.bench.vllm_engine import EngineShape

    return lambda _node: {"spec_name": "CPUOffloadingSpec",
                          "cpu_bytes_to_use": cpu_blocks * EngineShape().page_size}


@dataclass
class Overhead:
    """Median step seconds, offloaded hit tokens and admitted prompt tokens per
    repeat, for tierkv (`ours`) and vLLM's in-process CPU manager (`theirs`), run
    back to back."""

    ours: list[float]
    theirs: list[float]
    our_hits: list[int]
    their_hits: list[int]
    our_admitted: list[int] = field(default_factory=list)
    their_admitted: list[int] = field(default_factory=list)
    our_answered: list[float] = field(default_factory=list)  # `Timed.answered_first`
    their_answered: list[float] = field(default_factory=list)
    # Medians of each step with the `add_request` calls before it (`Timed.with_adds`).
    our_with_adds: list[float] = field(default_factory=list)
    their_with_adds: list[float] = field(default_factory=list)
    # Every timed step of every repeat, seconds: the distribution behind the medians.
    our_steps: list[float] = field(default_factory=list)
    their_steps: list[float] = field(default_factory=list)
    # With `--by-method`: each manager's calls, over every repeat's timed steps.
    our_methods: MethodTimes | None = None
    their_methods: MethodTimes | None = None

    def answered(self) -> str:
        """Admission: the share of requests answered in the step that first asked."""
        return (f"requests answered in the step first asking: tierkv "
                f"{statistics.median(self.our_answered):.1%}, vLLM "
                f"{statistics.median(self.their_answered):.1%} (goal >= {ANSWERED_GOAL:.0%})")

    def spread(self) -> str:
        """Where in the step's distribution the two back ends differ: a median can
        move while the mean does not (work moved between ordinary steps and those
        that admit many requests at once), and the other way round."""
        def points(steps: list[float]) -> str:
            cuts = statistics.quantiles(steps, n=100, method="inclusive") if len(steps) > 1 \
                else steps * 99
            ms = (cuts[24], statistics.median(steps), cuts[89], cuts[98], statistics.mean(steps))
            return "/".join(f"{v * 1e3:.2f}" for v in ms)
        return (f"every timed step, p25/median/p90/p99/mean ms: tierkv "
                f"{points(self.our_steps)}, vLLM {points(self.their_steps)}")

    def with_adds(self) -> str:
        """The step with the requests added before it: vLLM adds them on the engine's
        thread too, and tierkv looks a request up when it is added."""
        ours, theirs = statistics.median(self.our_with_adds), \
            statistics.median(self.their_with_adds)
        return (f"with the add_request calls before each step: tierkv {ours * 1e3:.3f} ms, "
                f"vLLM {theirs * 1e3:.3f} ms, ratio {ours / theirs:.2f}")


def overhead(workload: Workload, repeats: int, by_method: bool = False) -> Overhead:
    from tierkv.bench.vllm_engine import EngineShape, engine_node, tierkv_extra_config

    page = EngineShape().page_size
    out = Overhead([], [], [], [])
    if by_method:
        out.our_methods, out.their_methods = MethodTimes(), MethodTimes()
    for _ in range(repeats):
        theirs = step_times(vllm_cpu_extra(workload.cpu_blocks), workload, nullcontext(),
                            methods=out.their_methods)
        ours = step_times(tierkv_extra_config, workload,
                          engine_node(page, workload.cpu_blocks), methods=out.our_methods)
        out.theirs.append(statistics.median(theirs.seconds))
        out.ours.append(statistics.median(ours.seconds))
        out.their_hits.append(theirs.offloaded_hit_tokens)
        out.our_hits.append(ours.offloaded_hit_tokens)
        out.their_admitted.append(theirs.admitted_tokens)
        out.our_admitted.append(ours.admitted_tokens)
        out.their_answered.append(theirs.answered_first)
        out.our_answered.append(ours.answered_first)
        out.their_with_adds.append(statistics.median(theirs.with_adds()))
        out.our_with_adds.append(statistics.median(ours.with_adds()))
        out.their_steps.extend(theirs.seconds)
        out.our_steps.extend(ours.seconds)
    return out


# -- LMCache's multi-process mode, measured by its driver in the peers' environment ---

PEER_DRIVER = "tierkv.bench.peers.drivers.lmcache_step"
# Per timed or warm-up step and repeat, on top of a minute to import and start:
# LMCache's transfers run between the steps (its server copies), ~10 ms a step at
# 256 requests on a loaded core.
PEER_TIMEOUT_BASE_S = 120.0
PEER_TIMEOUT_PER_STEP_S = 0.5


@dataclass
class PeerStep:
    """The driver's answer: per repeat, the median step seconds, the offloaded hit
    tokens and the admitted prompt tokens while timed."""

    label: str
    seconds: list[float]
    hits: list[int]
    admitted: list[int]


def peer_env_or_reason(root: Path | None = None) -> Any:
    """The peers' environment (a `PeerEnv`) when it exists and holds LMCache and
    vLLM, else one line saying why the peer is skipped and how to build it.
    Never builds it: that is `python -m tierkv.bench.peers.env`'s (minutes, GBs)."""
    from tierkv.bench.peers import env as peer_env

    env = peer_env.existing(root)
    where = root or peer_env.cache_root()
    if env is None:
        return (f"LMCache MP skipped: no peers' environment at {where} (build it with "
                "`python -m tierkv.bench.peers.env`)")
    for peer in ("lmcache", "vllm"):
        if not env.usable(peer):
            return (f"LMCache MP skipped: {peer} is not usable in the peers' environment "
                    f"({env.skipped.get(peer, 'not installed')})")
    return env


def parse_peer(stdout: str, lmcache_version: str) -> PeerStep:
    """The driver's last stdout line (JSON) as a `PeerStep`."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("the LMCache MP driver printed no result")
    data = json.loads(lines[-1])
    version = (data.get("versions") or {}).get("lmcache", lmcache_version)
    return PeerStep(f"LMCache {version} MP", [float(v) for v in data["median_step_s"]],
                    [int(v) for v in data["offloaded_hit_tokens"]],
                    [int(v) for v in data["admitted_tokens"]])


def peer_step(workload: Workload, repeats: int, env: Any) -> PeerStep:
    """Run the LMCache MP driver on `workload` in the peers' environment `env`;
    its log (LMCache's and its server's) goes to `<env root>/vllm-lmcache-step.log`."""
    from tierkv.bench.peers.procs import REPO, tail

    log = env.root / "vllm-lmcache-step.log"
    process_env = env.process_env()
    process_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [process_env.get("PYTHONPATH")])])
    process_env["LMCACHE_DISABLE_BANNER"] = "1"
    timeout = PEER_TIMEOUT_BASE_S + PEER_TIMEOUT_PER_STEP_S * repeats * (
        workload.warmup + workload.steps)
    cmd = [str(env.python), "-m", PEER_DRIVER, "--workload", json.dumps(asdict(workload)),
           "--repeats", str(repeats)]
    with open(log, "wb") as err:
        try:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, env=process_env,
                                  cwd=str(REPO), timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"the LMCache MP driver did not finish within {timeout:.0f} s "
                               f"(PEER_TIMEOUT_*); last lines of {log}: {tail(log)}") from e
    if done.returncode != 0:
        raise RuntimeError(f"the LMCache MP driver exited with status {done.returncode}; "
                           f"last lines of {log}: {tail(log)}")
    return parse_peer(done.stdout.decode(errors="replace"),
                      env.versions.get("lmcache", "0.5.6"))


def per_step(tokens: list[int], steps: int) -> float:
    return statistics.median(tokens) / steps if tokens else 0.0


def peer_row(name: str, workload: Workload, repeats: int, o: Overhead,
             peer: PeerStep) -> Row:
    """The row of tierkv's step beside the peer's: as every row, the reference's
    time over ours. Not paired: the peer ran after tierkv's repeats, not between."""
    ours, theirs = statistics.median(o.ours), statistics.median(o.theirs)
    admitted_vllm = per_step(o.their_admitted, workload.steps)
    admitted_peer = per_step(peer.admitted, workload.steps)
    share = f" ({admitted_peer / admitted_vllm:.2f}x vLLM's)" if admitted_vllm else ""
    return Row("vllm", f"scheduler step, {workload.requests} running requests, {name}, "
                       f"{peer.label}",
               Stat.of(o.ours).scaled(1e3), "ms",
               f"the same step with {peer.label} (vLLM's LMCacheMPConnector, a cache "
               "server process)", ratio(peer.seconds, o.ours, paired=False),
               Stat.of(peer.seconds).scaled(1e3), paired=False,
               note=f"median of {workload.steps} steps per repeat, {repeats} repeats, run "
                    f"after tierkv's; {peer.label} {statistics.median(peer.seconds) / ours:.2f}"
                    f"x tierkv's step, {statistics.median(peer.seconds) / theirs:.2f}x "
                    f"vLLM's; prompt tokens admitted per step: tierkv "
                    f"{per_step(o.our_admitted, workload.steps):,.0f}, vLLM "
                    f"{admitted_vllm:,.0f}, {peer.label} {admitted_peer:,.0f}{share}; "
                    f"offloaded hit tokens while timed: tierkv "
                    f"{statistics.median(o.our_hits):,.0f}, {peer.label} "
                    f"{statistics.median(peer.hits):,.0f}")


def peer_line(peer: PeerStep, steps: int) -> str:
    """`python -m tierkv.bench.vllm`'s line for one system (tierkv, vLLM, a peer)."""
    return (f"{peer.label:<28} median step {statistics.median(peer.seconds) * 1e3:7.3f} ms "
            f"(repeats: {', '.join(f'{v * 1e3:.3f}' for v in peer.seconds)}); offloaded hit "
            f"tokens while timed: {', '.join(f'{h:,}' for h in peer.hits)}; admitted prompt "
            f"tokens per step: {per_step(peer.admitted, steps):,.0f}")


def run(part: Part, opts: Options) -> None:
    base = Workload(requests=64 if opts.quick else 256, steps=40 if opts.quick else 300,
                    warmup=20 if opts.quick else 60)
    repeats = opts.pick(1, 3)
    env = peer_env_or_reason()
    if isinstance(env, str):
        part.note(env)
    hits = base.tierkv_hits()
    queued = replace(hits, queued=hits.requests // 4)
    for name, workload, with_peer in (
            ("repeats in vLLM's GPU cache", base, True),
            ("repeats served by the offloading tier", hits, True),
            (f"repeats served by the offloading tier, {queued.queued} of them queued",
             queued, False)):
        o = overhead(workload, repeats)
        steps = workload.steps
        times = statistics.median(o.ours) / statistics.median(o.theirs)
        # As every part: the reference's time over ours (1.0: as fast as in-process).
        part.add(Row("vllm", f"scheduler step, {workload.requests} running requests, {name}",
                     Stat.of(o.ours).scaled(1e3), "ms", "the same step with vLLM's "
                     "CPUOffloadingManager (in-process)", ratio(o.theirs, o.ours),
                     Stat.of(o.theirs).scaled(1e3),
                     note=f"median of {workload.steps} steps per repeat, {repeats} repeats; "
                          f"{times:.2f}x vLLM's step (goal <= {OVERHEAD_GOAL}x); offloaded "
                          f"hit tokens while timed: tierkv {statistics.median(o.our_hits):,.0f}"
                          f", vLLM {statistics.median(o.their_hits):,.0f}; prompt tokens "
                          f"admitted per step: tierkv {per_step(o.our_admitted, steps):,.0f}"
                          f", vLLM {per_step(o.their_admitted, steps):,.0f}; {o.answered()}"
                          f"; {o.with_adds()}; {o.spread()}"))
        if with_peer and not isinstance(env, str) and not part.over_budget(
                f"LMCache MP, {name}"):
            try:
                part.add(peer_row(name, workload, repeats, o, peer_step(workload, repeats, env)))
            except (RuntimeError, ValueError, KeyError) as e:
                part.note(f"LMCache MP, {name}: failed: {e}")
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
    parser.add_argument("--queued", type=int, default=0,
                        help="of the requests, how many wait in vLLM's queue (the engine "
                             "runs the others at most)")
    parser.add_argument("--by-method", action="store_true",
                        help="also time each manager method vLLM calls, per back end "
                             "(the step's figure then includes the timing's own cost)")
    args = parser.parse_args(argv)
    if not 0 <= args.queued < args.requests:
        parser.error(f"--queued must be 0 to {args.requests - 1}, got {args.queued}")
    workload = Workload(requests=args.requests, steps=args.steps)
    if args.tierkv_hits:
        workload = workload.tierkv_hits()
    workload = replace(workload, queued=args.queued)
    o = overhead(workload, args.repeats, args.by_method)
    for system in (PeerStep("tierkv", o.ours, o.our_hits, o.our_admitted),
                   PeerStep("vLLM CPUOffloadingManager", o.theirs, o.their_hits,
                            o.their_admitted)):
        print(peer_line(system, workload.steps))
    print(f"ratio tierkv / vLLM: {statistics.median(o.ours) / statistics.median(o.theirs):.2f} "
          f"(goal <= {OVERHEAD_GOAL})")
    print(o.answered())
    print(o.with_adds())
    print(o.spread())
    if o.our_methods is not None and o.their_methods is not None:
        print("\n".join(report(o.our_methods, o.their_methods, workload.steps * args.repeats)))
        print(paired(o.our_steps, o.our_methods, o.their_steps, o.their_methods))
    env = peer_env_or_reason()
    if isinstance(env, str):
        print(env)
        return 0
    try:
        peer = peer_step(workload, args.repeats, env)
    except (RuntimeError, ValueError, KeyError) as e:
        print(f"LMCache MP: failed: {e}")
        return 1
    print(peer_line(peer, workload.steps))
    print(f"ratio {peer.label} / tierkv: "
          f"{statistics.median(peer.seconds) / statistics.median(o.ours):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
