"""Trace replay: hit ratios of the CPU-tier policies, with and without engine hints,
measured against a true upper bound.

`replay` runs a trace through the real in-process `PrimaryTier` (the same code the
broker runs, with the replay rule of `tierkv.workloads.traces.prefix_hit_ratio`), so a
number here is what the service would do, not what a model of it would.
`policy_table` puts every policy, in every hint mode, next to the bound of
`tierkv.bench.belady.reference` at each capacity; the geometric mean of the fractions
of the bound is the one figure that ranks policies across cache sizes without
letting one size dominate. `main` is the `tierkv replay` command.

A policy is named as in the registry (`lru`, `arc`, `histarc`, `hitdensity`, ...),
optionally with `+reuse` or `+reuseN`: the policy behind a `ReuseFilter` of
threshold N (2).

Hints, derived from the trace the way an engine would see them (`HintMode`):

* `cont` (continuation): each request carries its session and turn, reconstructed
  from the trace's structure (`tierkv.workloads.traces.sessions`), and `continues`: whether
  the session sends another request, flipped with probability `error` (`cont:0.1`
  is a hint right 90 % of the time; `cont:1` is always wrong).
* `queue:K`: before each request the tier sees the key chains of the next K
  requests in arrival order, the engine's waiting queue.
* `cont:E+queue:K`: both. `none`: no hints (the chain of each request is still
  passed, as every lookup passes it).

A policy that ignores hints gives the same figures in every mode; the table
replays it once and says so.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tierkv.bench.belady import BoundResult, reference
from tierkv.core.policies import CachePolicy, make_policy
from tierkv.core.policies.hints import RequestHints
from tierkv.core.primary import PrimaryTier
from tierkv.core.reuse import ReuseFilter
from tierkv.workloads.traces import (
    Request,
    default_trace_path,
    prefix_hit_ratio,
    read_trace,
    sessions,
)

DEFAULT_CAPACITIES = (1000, 4000, 16000)
DEFAULT_POLICIES = ("lru", "arc", "lru+reuse", "histarc", "hitdensity")
DEFAULT_HINTS = ("none", "cont:0.1", "queue:32", "cont:0.1+queue:32", "cont:1")
_VARIANT = re.compile(r"^(?P<policy>[^+]+)(?:\+reuse(?P<threshold>\d*))?$")


@dataclass(frozen=True, slots=True)
class HintMode:
    """Which hints a replay derives from the trace (see the module's doc)."""

    continuation: bool = False
    error: float = 0.0  # probability that a continuation hint is wrong
    queue: int = 0  # requests of the waiting queue visible per step
    seed: int = 0  # of the error draws

    def __post_init__(self) -> None:
        if not 0.0 <= self.error <= 1.0:
            raise ValueError(f"error must be in [0, 1], got {self.error}")
        if self.queue < 0:
            raise ValueError(f"queue must be >= 0, got {self.queue}")

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> HintMode:
        """`none`, `cont[:ERROR]`, `queue:K`, or `cont[:ERROR]+queue:K`."""
        continuation, error, queue = False, 0.0, 0
        if text != "none":
            for part in text.split("+"):
                name, _, value = part.partition(":")
                try:
                    if name == "cont":
                        continuation, error = True, float(value) if value else 0.1
                    elif name == "queue":
                        queue = int(value)
                    else:
                        raise ValueError
                except ValueError:
                    raise ValueError(f"not a hint mode: {text!r} (expected none, cont[:ERROR], "
                                     "queue:K or cont[:ERROR]+queue:K)") from None
        return cls(continuation, error, queue, seed)

    @property
    def label(self) -> str:
        parts = []
        if self.continuation:
            parts.append(f"cont {round(100 * (1 - self.error))}%")
        if self.queue:
            parts.append(f"queue {self.queue}")
        return " + ".join(parts) if parts else "no hints"

    @property
    def any(self) -> bool:
        return self.continuation or self.queue > 0


NO_HINTS = HintMode()


def derive_hints(requests: Sequence[Request], mode: HintMode) -> list[RequestHints | None]:
    """Per-request hints of `mode` (None for every request without continuation)."""
    if not mode.continuation:
        return [None] * len(requests)
    structure = sessions(requests)
    rng = random.Random(mode.seed)
    out: list[RequestHints | None] = []
    for sid, turn, continues in zip(structure.session, structure.turn, structure.continues,
                                    strict=True):
        if mode.error and rng.random() < mode.error:
            continues = not continues
        out.append(RequestHints(session=sid, turn=turn, continues=continues))
    return out


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
    hints: HintMode | Sequence[RequestHints | None] | None = None,
    queue: int | None = None,
) -> ReplayResult:
    """Replay `requests` against a `PrimaryTier` of `capacity` blocks.

    `policy_name` is a registered policy, or `NAME+reuse[N]` to put it behind a
    reuse filter; `reuse_threshold` does the same for a plain name. `hints` is a
    `HintMode` (derived here) or precomputed per-request hints; `queue` overrides
    the mode's queue length."""
    policy, threshold = parse_policy(policy_name)
    if reuse_threshold is not None:
        threshold = reuse_threshold
    if isinstance(hints, HintMode):
        queue = hints.queue if queue is None else queue
        hints = derive_hints(requests, hints) if hints.continuation else None
    reuse = ReuseFilter(threshold, reuse_entries) if threshold is not None else None
    tier = PrimaryTier(capacity, make_policy(policy, capacity), reuse_filter=reuse,
                       enable_events=False)
    prefix_hit_ratio(requests, tier, hints=hints, queue=queue or 0)
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


def uses_hints(policy_name: str) -> bool:
    """Whether the policy overrides any of the hint methods of `CachePolicy`."""
    cls = type(make_policy(parse_policy(policy_name)[0], 1))
    return any(getattr(cls, m) is not getattr(CachePolicy, m)
               for m in ("note_request", "note_finish", "note_queue"))


def row_name(policy: str, mode: HintMode) -> str:
    return policy if not mode.any else f"{policy} [{mode.label}]"


@dataclass(frozen=True, slots=True)
class PolicyTable:
    """Hit ratios per policy (and hint mode) and capacity, with the references.

    `optimum` is the bound the fractions use: Belady with bypass where it is the
    exact optimum (prefix-consistent traces), else an upper bound on any-position
    hits (`tierkv.bench.belady.reference`); `demand` is Belady storing every block, the
    best of admit-all policies (not a bound when `exact` is False)."""

    capacities: tuple[int, ...]
    rows: dict[str, tuple[ReplayResult, ...]]
    optimum: tuple[BoundResult, ...]
    demand: tuple[BoundResult, ...]
    exact: bool = True
    same_as: dict[str, str] | None = None  # row -> the row it equals (hints ignored)

    def fractions(self, policy: str) -> list[float]:
        return [_fraction(r.hit_ratio, b.hit_ratio) for r, b in zip(self.rows[policy],
                                                                 self.optimum, strict=True)]

    def geomean(self, policy: str) -> float:
        return geometric_mean(self.fractions(policy))

    def format(self, title: str = "") -> str:
        width = max([14, *(len(name) + 2 for name in self.rows)])
        head = f"{'policy':<{width}}" + "".join(f"{c:>16}" for c in self.capacities) + "   geomean"
        lines = [title] if title else []
        lines += [head, "-" * len(head)]
        for name, results in self.rows.items():
            cells = "".join(f"{r.hit_ratio:9.4f} ({f:4.2f})"
                            for r, f in zip(results, self.fractions(name), strict=True))
            lines.append(f"{name:<{width}}{cells}   {self.geomean(name):7.3f}")
        bound = "belady" if self.exact else "bound"
        for label, refs in ((bound, self.optimum), ("belady-demand", self.demand)):
            cells = "".join(f"{b.hit_ratio:9.4f} ({_fraction(b.hit_ratio, o.hit_ratio):4.2f})"
                            for b, o in zip(refs, self.optimum, strict=True))
            lines.append(f"{label:<{width}}{cells}")
        if self.exact:
            lines.append("cells: hit ratio (fraction of Belady's with bypass, the exact "
                         "optimum: every id follows one parent); geomean of fractions")
        else:
            lines.append("cells: hit ratio (fraction of an upper bound: Belady on any-position "
                         "hits, ids follow several parents or repeat); geomean of fractions")
        if self.same_as:
            lines.append("policies that ignore hints: one row stands for every hint mode")
        return "\n".join(lines)


def policy_table(
    requests: Sequence[Request],
    capacities: Sequence[int] = DEFAULT_CAPACITIES,
    policies: Sequence[str] = DEFAULT_POLICIES,
    hint_modes: Sequence[HintMode] = (NO_HINTS,),
) -> PolicyTable:
    """Replay every policy at every capacity in every hint mode, and the references.
    A policy that ignores hints is replayed once."""
    ids = [r.hash_ids for r in requests]
    derived = {mode: derive_hints(requests, mode) for mode in hint_modes if mode.continuation}
    rows: dict[str, tuple[ReplayResult, ...]] = {}
    same_as: dict[str, str] = {}
    for name in policies:
        hinted = uses_hints(name)
        for mode in hint_modes:
            if mode.any and not hinted:
                continue
            hints = derived.get(mode)
            rows[row_name(name, mode)] = tuple(
                replay(requests, c, name, hints=hints, queue=mode.queue) for c in capacities)
        if not hinted and any(m.any for m in hint_modes):
            same_as[name] = name
    refs = [reference(ids, c) for c in capacities]
    return PolicyTable(
        tuple(capacities),
        rows,
        tuple(r.bound for r in refs),
        tuple(r.demand for r in refs),
        exact=all(r.exact for r in refs),
        same_as=same_as or None,
    )


def geometric_mean(values: Sequence[float]) -> float:
    if not values or any(v <= 0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _fraction(hit_ratio: float, optimum: float) -> float:
    return hit_ratio / optimum if optimum else 0.0


# -- the replay set: a trace and the synthetic workloads -------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """A named trace of the replay set: a file, or a synthetic preset and seed."""

    name: str
    path: Path | None = None
    seed: int = 0
    n_requests: int = 0
    limit: int | None = None

    def load(self) -> list[Request]:
        if self.path is not None:
            return read_trace(self.path, self.limit)
        from tierkv.workloads.synthetic import generate_workload

        return generate_workload(self.name, self.n_requests, seed=self.seed)

    @property
    def title(self) -> str:
        if self.path is not None:
            return self.path.name
        return f"synthetic '{self.name}' (seed {self.seed})"


def workload_table(
    workload: Workload,
    capacities: Sequence[int],
    policies: Sequence[str],
    hint_modes: Sequence[HintMode],
) -> tuple[Workload, PolicyTable, str]:
    t0 = time.perf_counter()
    requests = workload.load()
    table = policy_table(requests, capacities, policies, hint_modes)
    title = (f"{workload.title}: {len(requests):,} requests, "
             f"{sum(len(r.hash_ids) for r in requests):,} block lookups")
    return workload, table, f"{table.format(title)}\n({time.perf_counter() - t0:.0f} s)"


def summary(results: Sequence[tuple[Workload, PolicyTable]], baseline: str = "lru") -> str:
    """Every policy row on every workload: the geometric mean of its fractions of the
    bound (workloads as rows, policy rows as numbered columns), then per policy row
    its lowest hit count relative to `baseline` at any capacity of any workload and
    the number of (workload, capacity) cells where it is below."""
    names: list[str] = []
    for _, table in results:
        names += [n for n in table.rows if n not in names]
    labels = [w.path.stem if w.path is not None else f"{w.name}/{w.seed}" for w, _ in results]
    width = max([12, *(len(label) + 2 for label in labels)])
    head = f"{'workload':<{width}}" + "".join(f"{f'({i + 1})':>8}" for i in range(len(names)))
    lines = ["geomean fraction of the bound (Belady where exact, else the any-position "
             "upper bound) over the capacities", head, "-" * len(head)]
    for label, (_, table) in zip(labels, results, strict=True):
        row = "".join(f"{table.geomean(n):>8.3f}" if n in table.rows else f"{'':>8}"
                      for n in names)
        lines.append(f"{label:<{width}}{row}")
    lines.append("")
    lines.append(f"{'column':<8}{'policy':<36}{f'min/{baseline}':>10}{'cells below':>13}")
    for i, name in enumerate(names):
        worst, below, cells = math.inf, 0, 0
        for _, table in results:
            if name not in table.rows or baseline not in table.rows:
                continue
            for r, b in zip(table.rows[name], table.rows[baseline], strict=True):
                if b.hit_blocks:
                    worst = min(worst, r.hit_blocks / b.hit_blocks)
                    below += r.hit_blocks < b.hit_blocks
                    cells += 1
        worst_text = f"{worst:10.4f}" if cells else f"{'-':>10}"
        lines.append(f"{f'({i + 1})':<8}{name:<36}{worst_text}{f'{below}/{cells}':>13}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from tierkv.workloads.synthetic import PRESETS

    parser = argparse.ArgumentParser(
        prog="tierkv replay",
        description="Replay Mooncake-format traces and synthetic workloads: policy hit "
                    "ratios, with and without engine hints, against a true upper bound.")
    parser.add_argument("trace", type=Path, nargs="*",
                        help="Mooncake-format JSONL traces (none: the conversation trace if "
                             "present, with --workloads)")
    parser.add_argument("--workloads", nargs="*", default=None, metavar="NAME",
                        help=f"synthetic presets ({', '.join(PRESETS)}; 'all': every one); "
                             "default: none when a trace is given, else all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds per preset")
    parser.add_argument("--requests", type=int, default=6000, help="requests per preset")
    parser.add_argument("--capacities", type=int, nargs="+", default=list(DEFAULT_CAPACITIES),
                        help="CPU-tier sizes in blocks")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                        help="policy names; NAME+reuse[N] adds a reuse filter")
    parser.add_argument("--hints", nargs="+", default=list(DEFAULT_HINTS),
                        help="hint modes: none, cont[:ERROR], queue:K, cont[:ERROR]+queue:K")
    parser.add_argument("--hint-seed", type=int, default=0, help="seed of the hint errors")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--jobs", type=int, default=1, help="tables replayed in parallel")
    return parser


def main(argv: list[str] | None = None) -> int:
    from tierkv.workloads.synthetic import PRESETS

    argv = sys.argv[1:] if argv is None else argv
    if "--ttft" in argv:  # the TTFT simulation parses its own options (and --help)
        from tierkv.bench.ttft_sim import main as ttft_main

        return ttft_main([a for a in argv if a != "--ttft"])
    args = build_parser().parse_args(argv)
    if any(c <= 0 for c in args.capacities):
        raise SystemExit("tierkv replay: capacities must be positive")
    for name in args.policies:
        try:
            make_policy(parse_policy(name)[0], 1)
        except ValueError as e:
            raise SystemExit(f"tierkv replay: {e}") from None
    try:
        modes = list(dict.fromkeys(HintMode.parse(h, args.hint_seed) for h in args.hints))
    except ValueError as e:
        raise SystemExit(f"tierkv replay: {e}") from None
    traces = list(args.trace)
    presets = args.workloads
    if not traces and presets is None:
        found = default_trace_path()
        traces = [found] if found else []
        presets = ["all"]
    presets = list(PRESETS) if presets and "all" in presets else (presets or [])
    for name in presets:
        if name not in PRESETS:
            raise SystemExit(f"tierkv replay: unknown workload {name!r}; known: "
                             f"{', '.join(PRESETS)}")
    for path in traces:
        if not path.exists():
            raise SystemExit(f"tierkv replay: no trace at {path}")
    workloads = [Workload(p.name, path=p, limit=args.limit) for p in traces]
    workloads += [Workload(name, seed=seed, n_requests=args.requests)
                  for name in presets for seed in args.seeds]
    if not workloads:
        raise SystemExit("tierkv replay: nothing to replay (give a trace or --workloads)")
    jobs = max(1, min(args.jobs, len(workloads), os.cpu_count() or 1))
    todo = [(w, args.capacities, args.policies, modes) for w in workloads]
    results: list[tuple[Workload, PolicyTable]] = []
    if jobs == 1:
        outputs = (workload_table(*job) for job in todo)
    else:
        pool = ProcessPoolExecutor(max_workers=jobs)
        outputs = (f.result() for f in [pool.submit(workload_table, *job) for job in todo])
    for workload, table, text in outputs:
        print(text, end="\n\n", flush=True)
        results.append((workload, table))
    if jobs > 1:
        pool.shutdown()
    if len(results) > 1:
        print(summary(results))
    return 0
