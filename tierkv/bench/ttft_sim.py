"""Time to first token under three load-or-recompute policies, simulated.

GPU-class figures cannot be measured on every machine, so this replays a
Mooncake-format trace through a model of one engine and its tiers, on a virtual
clock, and runs the real decision code on it: the real `TieringManager` (and so the
real `_weigh`, `TierCosts` with their `prior_for` defaults, `best_split`, wait
bounds and background promotions) over the real `PrimaryTier`, with simulated
secondary tiers. Only bytes and GPU time are modelled; every decision is tierkv's.

The model (defaults: public H100 figures for an 8B model):

* **KV size**: Llama-3-8B, 32 layers x 8 KV heads x head dim 128 x 2 (K, V) x 2
  bytes (bf16) = 128 KiB per token; a trace block is 512 tokens, 64 MiB.
* **Engine**: one H100 prefilling one request at a time in arrival order (a FIFO
  server) at 15,000 tokens/s; decode is not modelled. A request's TTFT is its wait
  in the queue, its wait for promotions, its CPU->GPU load (PCIe 5, 25 GB/s) and
  the prefill of what was not loaded (at least one token, as an engine always
  computes the last one).
* **Tiers**: a CPU tier of `cpu_blocks` (LRU; the real `PrimaryTier`), a local NVMe
  disk of `disk_blocks` (LRU, 0.1 ms + 3 GB/s) and S3 holding every block ever
  computed (30 ms + 1 GB/s). A computed block is stored into the CPU tier and
  cascaded to both (stores are free: they do not delay loads); a block loaded from
  S3 is cascaded to the disk again. A tier serves its loads one job at a time, in
  submission order (one queue shared by every request): a job of `n` blocks takes
  the latency (once: its GETs go out together) plus `n` blocks at the bandwidth.
  A promoted block becomes a CPU block.
* **Arrivals**: the trace's timestamps divided by `speedup`. The default 0.25
  slows the trace down: it was recorded on a cluster, and one H100 at 15,000
  tokens/s offered it would be loaded 2.7 times over.
* **Steps**: a request waiting for promotions asks again at the next tier
  completion, or after `step_ms` (an idle engine's step; 20 ms, the granularity
  `tierkv.core.costs.WAIT_SLACK_S` allows for), whichever is first.

Policies, replayed on the same trace:

* `never-offload`: every request computes its whole prompt.
* `always-load`: every block any tier holds is loaded (lookups without a
  recompute cost: each held block of the leading run is promoted, and the request
  waits for all of them).
* `tierkv`: lookups with `Recompute(block_tokens / prefill_tps)`: the rule decides,
  learning each tier's line from the loads it makes, from the per-type priors
  (`--priors true` starts them at the simulated figures instead, to tell a wrong
  prior from a wrong rule).

The goal the figures are checked against: tierkv's mean TTFT at most the better of
the other two, and no request slower than 1.1 times its never-offload TTFT.
`main` is `tierkv replay --ttft`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tierkv.core.costs import WAIT_SLACK_S, Recompute
from tierkv.core.keys import OffloadEvent, OffloadKey
from tierkv.core.primary import PrimaryTier
from tierkv.core.tiering import TieringManager
from tierkv.tiers.base import Job, JobResult, SecondaryTier
from tierkv.workloads.traces import MOONCAKE_BLOCK_TOKENS, Request, default_trace_path, read_trace

POLICIES = ("never-offload", "always-load", "tierkv")
SLOWER_FACTOR = 1.1  # a request this much slower than never-offload counts as hurt
UNBOUNDED_POLL_S = 1.0  # how often a request that waits for all its loads asks again
MAX_POLLS = 1_000_000  # per request: a waiting loop that never ends is a bug here


@dataclass(frozen=True, slots=True)
class SimParams:
    """The simulated machine (units as on the command line)."""

    prefill_tps: float = 15_000.0
    kv_bytes_per_token: int = 128 * 1024
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    cpu_gbps: float = 25.0
    cpu_blocks: int = 4000  # 250 GiB of pinned host memory
    disk_latency_ms: float = 0.1
    disk_gbps: float = 3.0
    disk_blocks: int = 16000  # 1 TiB of NVMe; 0: no disk tier, S3 alone
    s3_latency_ms: float = 30.0
    s3_gbps: float = 1.0
    speedup: float = 0.25
    step_ms: float = WAIT_SLACK_S * 1e3  # the step granularity the rule's bound allows for
    priors: str = "default"  # or "true": the rule starts at the simulated figures

    def __post_init__(self) -> None:
        for name in ("prefill_tps", "cpu_gbps", "disk_gbps", "s3_gbps", "speedup", "step_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("disk_latency_ms", "s3_latency_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_bytes_per_token <= 0 or self.block_tokens <= 0 or self.cpu_blocks <= 0:
            raise ValueError("kv_bytes_per_token, block_tokens and cpu_blocks must be > 0")
        if self.disk_blocks < 0:
            raise ValueError(f"disk_blocks must be >= 0, got {self.disk_blocks}")
        if self.priors not in ("default", "true"):
            raise ValueError(f"priors must be 'default' or 'true', got {self.priors!r}")

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token

    @property
    def seconds_per_block(self) -> float:
        """What recomputing one block costs the engine."""
        return self.block_tokens / self.prefill_tps


class SimClock:
    """The virtual time every part reads (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimTier(SecondaryTier):
    """A secondary tier on the virtual clock: an LRU of keys (no bytes) whose loads
    are served one job at a time, each `latency + blocks * block_bytes / bandwidth`.
    Stores land at once (they are not what a request waits for)."""

    def __init__(self, name: str, clock: SimClock, latency_s: float, bandwidth: float,
                 block_bytes: int, capacity: int | None = None) -> None:
        self.name = name
        self.type = name  # what `prior_for` knows the tier by
        self.clock = clock
        self.latency_s, self.bandwidth, self.block_bytes = latency_s, bandwidth, block_bytes
        self.capacity = capacity
        self._keys: OrderedDict[OffloadKey, None] = OrderedDict()
        self._loads: list[tuple[float, JobResult]] = []  # FIFO: finish times never decrease
        self._stored: list[JobResult] = []
        self._free_at = 0.0  # when the job last queued ends

    def lookup(self, key: OffloadKey) -> bool | None:
        return key in self._keys

    def submit_store(self, job: Job) -> None:
        for key in job.keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while self.capacity is not None and len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        self._stored.append(JobResult(job.job_id, True, job.keys))

    def submit_load(self, job: Job) -> None:
        held = tuple(k for k in job.keys if k in self._keys)
        self.touch(held)
        start = max(self.clock.now, self._free_at)
        self._free_at = start + self.latency_s + len(job.keys) * self.block_bytes / self.bandwidth
        self._loads.append((self._free_at, JobResult(job.job_id, len(held) == len(job.keys),
                                                     held)))

    def get_finished(self) -> list[JobResult]:
        done, self._stored = self._stored, []
        now = self.clock.now
        n = 0
        while n < len(self._loads) and self._loads[n][0] <= now:
            n += 1
        done += [result for _, result in self._loads[:n]]
        del self._loads[:n]
        return done

    def next_finish(self) -> float:
        """When the oldest load in flight ends (inf: none is)."""
        return self._loads[0][0] if self._loads else math.inf

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if key in self._keys:
                self._keys.move_to_end(key)

    def take_events(self) -> list[OffloadEvent]:
        return []

    def stats(self) -> dict[str, Any]:
        return {"blocks": len(self._keys), "loads_in_flight": len(self._loads)}

    def drain(self, timeout: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        self._loads.clear()

    @property
    def in_flight(self) -> int:
        return len(self._loads)


@dataclass(slots=True)
class PolicyResult:
    """One policy's replay: per-request TTFTs and where the prompt tokens came from."""

    policy: str
    ttft_s: list[float] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("cpu", "disk", "s3", "computed"), 0))
    learned: dict[str, dict[str, float]] = field(default_factory=dict)  # tier -> its line
    slower: int = 0  # requests over SLOWER_FACTOR x their never-offload TTFT

    @property
    def mean_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else 0.0

    def percentile(self, q: float) -> float:
        """Nearest rank: the TTFT that `q` of the requests do not exceed."""
        if not self.ttft_s:
            return 0.0
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    def shares(self) -> dict[str, float]:
        total = sum(self.tokens.values())
        return {k: v / total if total else 0.0 for k, v in self.tokens.items()}

    def summary(self) -> dict[str, Any]:
        return {"mean_s": self.mean_s, "p50_s": self.percentile(0.5),
                "p99_s": self.percentile(0.99), "token_shares": self.shares(),
                "slower_than_never_offload": self.slower, "requests": len(self.ttft_s),
                **({"learned": self.learned} if self.learned else {})}


def arrival_s(request: Request, params: SimParams) -> float:
    return request.timestamp_ms / 1000.0 / params.speedup


def never_offload(requests: Sequence[Request], params: SimParams) -> PolicyResult:
    """The FIFO engine computing every prompt whole."""
    result = PolicyResult("never-offload")
    free_at = 0.0
    for request in requests:
        arrival = arrival_s(request, params)
        free_at = max(arrival, free_at) + max(1, request.input_length) / params.prefill_tps
        result.ttft_s.append(free_at - arrival)
        result.tokens["computed"] += request.input_length
    return result


class _Node:
    """The real manager over the simulated tiers, on one virtual clock."""

    def __init__(self, params: SimParams) -> None:
        self.params = params
        self.clock = SimClock()
        bb = params.block_bytes
        self.tiers = [SimTier("s3", self.clock, params.s3_latency_ms / 1e3, params.s3_gbps * 1e9,
                              bb)]
        if params.disk_blocks:
            self.tiers.insert(0, SimTier("disk", self.clock, params.disk_latency_ms / 1e3,
                                         params.disk_gbps * 1e9, bb, params.disk_blocks))
        priors = None  # the manager's own: `prior_for` each tier's type
        if params.priors == "true":
            priors = [(t.latency_s, t.bandwidth) for t in self.tiers]
        primary = PrimaryTier(params.cpu_blocks, "lru", enable_events=False)
        self.manager = TieringManager(primary, self.tiers, clock=self.clock, block_bytes=bb,
                                      cost_priors=priors)

    def advance_to(self, t: float) -> None:
        """Move the clock to `t`, stepping the manager at every tier completion on
        the way, as the broker's loop would (it learns a load's time when it ends,
        not when the engine next asks)."""
        clock = self.clock
        while True:
            due = min((tier.next_finish() for tier in self.tiers), default=math.inf)
            if due > t:
                break
            clock.now = max(clock.now, due)
            self.manager.step()
        clock.now = max(clock.now, t)

    def wait_for_loads(self, keys: list[OffloadKey], req_id: str,
                       recompute: Recompute | None) -> int:
        """Look up as an engine does, each step, until the lookup stops asking to
        wait. Returns the leading hits it may load."""
        manager, clock = self.manager, self.clock
        # Without a bound nothing changes between completions but the leases, which
        # a lookup renews: asking each second keeps them (and costs little).
        step_s = self.params.step_ms / 1e3 if recompute is not None else UNBOUNDED_POLL_S
        for _ in range(MAX_POLLS):
            look = manager.lookup(keys, req_id, recompute=recompute)
            manager.step()
            busy = [t.next_finish() for t in self.tiers if t.in_flight]
            if not look.pending or (look.retry and not busy):
                return look.hits  # done, or no CPU room that any landing would free
            clock.now = max(clock.now, min([*busy, clock.now + step_s]))
        raise RuntimeError(f"request {req_id} still waiting after {MAX_POLLS} lookups")

    def serve(self, request: Request, req_id: str, recompute: Recompute | None,
              tokens: dict[str, int]) -> None:
        """One request from its lookup to the end of its prefill (the clock ends
        there); its tokens counted by source."""
        manager, params = self.manager, self.params
        keys = request.keys()
        hits = self.wait_for_loads(keys, req_id, recompute)
        _, sources = manager.prepare_load_from(keys[:hits], req_id)
        manager.complete_load(keys[:hits])
        loaded = min(request.input_length, hits * params.block_tokens)
        promoted = 0
        for tier, blocks in sources.items():
            tokens[tier] += blocks * params.block_tokens
            promoted += blocks * params.block_tokens
        tokens["cpu"] += max(0, loaded - promoted)
        tokens["computed"] += request.input_length - loaded
        gpu_load = hits * params.block_bytes / (params.cpu_gbps * 1e9)
        prefill = max(1, request.input_length - loaded) / params.prefill_tps
        self.advance_to(self.clock.now + gpu_load + prefill)
        out = manager.prepare_store(keys, req_id)
        if out is not None and out.keys_to_store:
            manager.complete_store(out.keys_to_store)
        manager.finish(req_id)
        manager.step()


def replay_policy(requests: Sequence[Request], params: SimParams, policy: str) -> PolicyResult:
    """Replay the trace under `policy` (one of `POLICIES`)."""
    if policy == "never-offload":
        return never_offload(requests, params)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    recompute = Recompute(params.seconds_per_block) if policy == "tierkv" else None
    node = _Node(params)
    result = PolicyResult(policy)
    free_at = 0.0
    for i, request in enumerate(requests):
        arrival = arrival_s(request, params)
        node.advance_to(max(arrival, free_at))
        node.serve(request, f"r{i}", recompute, result.tokens)
        free_at = node.clock.now
        result.ttft_s.append(free_at - arrival)
    if recompute is not None:
        now = node.clock.now
        result.learned = {t.name: node.manager.costs[i].as_dict(now)
                          for i, t in enumerate(node.tiers)}
    return result


@dataclass(slots=True)
class TtftReport:
    params: SimParams
    trace: str
    results: dict[str, PolicyResult]

    @property
    def goal_met(self) -> bool:
        rule = self.results["tierkv"]
        others = [r.mean_s for name, r in self.results.items() if name != "tierkv"]
        return rule.mean_s <= min(others) and rule.slower == 0

    def as_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "params": asdict(self.params),
                "policies": {name: r.summary() for name, r in self.results.items()},
                "goal_met": self.goal_met}


def compare(requests: Sequence[Request], params: SimParams, trace: str = "") -> TtftReport:
    """Every policy on the same trace, each request's TTFT against never-offload's."""
    if not requests:
        raise ValueError("no requests to replay")
    results = {policy: replay_policy(requests, params, policy) for policy in POLICIES}
    base = results["never-offload"].ttft_s
    for result in results.values():
        result.slower = sum(t > SLOWER_FACTOR * b for t, b in zip(result.ttft_s, base,
                                                                  strict=True))
    return TtftReport(params, trace, results)


def describe(params: SimParams) -> str:
    disk = (f"disk {params.disk_blocks} blocks, {params.disk_latency_ms:g} ms + "
            f"{params.disk_gbps:g} GB/s; " if params.disk_blocks else "no disk tier; ")
    return (f"engine {params.prefill_tps:,.0f} tokens/s prefill, FIFO; KV "
            f"{params.kv_bytes_per_token / 1024:g} KiB/token, block {params.block_tokens} "
            f"tokens ({params.block_bytes / 2**20:g} MiB, recompute "
            f"{params.seconds_per_block * 1e3:.1f} ms); CPU {params.cpu_blocks} blocks, "
            f"{params.cpu_gbps:g} GB/s to the GPU; {disk}S3 every block, "
            f"{params.s3_latency_ms:g} ms + {params.s3_gbps:g} GB/s; arrivals x"
            f"{params.speedup:g}; rule priors: {params.priors}")


def format_report(report: TtftReport) -> str:
    head = (f"{'policy':<15}{'mean s':>9}{'p50 s':>9}{'p99 s':>9}{'cpu':>7}{'disk':>7}"
            f"{'s3':>7}{'computed':>10}{'>1.1x never':>13}")
    lines = [f"{report.trace}: {len(report.results['tierkv'].ttft_s):,} requests",
             describe(report.params), head, "-" * len(head)]
    for name, r in report.results.items():
        s = r.shares()
        lines.append(f"{name:<15}{r.mean_s:9.3f}{r.percentile(0.5):9.3f}"
                     f"{r.percentile(0.99):9.3f}{s['cpu']:7.1%}{s['disk']:7.1%}{s['s3']:7.1%}"
                     f"{s['computed']:10.1%}{r.slower:13d}")
    for tier, line in report.results["tierkv"].learned.items():
        lines.append(f"tierkv learned {tier}: {line['latency_ms']:g} ms + "
                     f"{line['bandwidth_mb_s'] / 1e3:.3g} GB/s ({line['samples']} loads)")
    lines.append("goal (tierkv mean <= the better of the others, none over 1.1x "
                 f"never-offload): {'met' if report.goal_met else 'NOT met'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    d = SimParams()
    p = argparse.ArgumentParser(
        prog="tierkv replay --ttft",
        description="Simulated TTFT of never-offload, always-load and tierkv's "
                    "load-or-recompute rule on a Mooncake trace (defaults: Llama-3-8B on "
                    "one H100; see tierkv/bench/ttft_sim.py).")
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake-format JSONL (default: the shared conversation trace)")
    p.add_argument("--requests", type=int, default=None, help="replay the first N requests")
    p.add_argument("--speedup", type=float, default=d.speedup,
                   help=f"arrival timestamps divided by this (default {d.speedup})")
    for name, help_text in (
        ("prefill_tps", "engine prefill, tokens/s"),
        ("kv_bytes_per_token", "KV bytes per token"),
        ("cpu_gbps", "CPU -> GPU, GB/s"),
        ("cpu_blocks", "CPU-tier capacity, blocks"),
        ("disk_latency_ms", "disk latency per load job, ms"),
        ("disk_gbps", "disk bandwidth, GB/s"),
        ("disk_blocks", "disk capacity, blocks (0: no disk tier)"),
        ("s3_latency_ms", "S3 latency per load job, ms"),
        ("s3_gbps", "S3 bandwidth, GB/s"),
        ("step_ms", "an idle engine's step while it waits for loads, ms"),
    ):
        default = getattr(d, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                       help=f"{help_text} (default {default:g})")
    p.add_argument("--priors", choices=("default", "true"), default=d.priors,
                   help="the rule's starting lines: the per-type defaults, or the "
                        "simulated figures")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p


def params_from(args: argparse.Namespace) -> SimParams:
    fields = SimParams.__dataclass_fields__
    return SimParams(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    trace = args.trace or default_trace_path()
    if trace is None or not trace.exists():
        raise SystemExit(f"tierkv replay --ttft: no trace at {trace} (give --trace FILE)")
    if args.requests is not None and args.requests <= 0:
        raise SystemExit("tierkv replay --ttft: --requests must be positive")
    try:
        params = params_from(args)
        report = compare(read_trace(trace, args.requests), params, trace.name)
    except ValueError as e:
        raise SystemExit(f"tierkv replay --ttft: {e}") from None
    print(format_report(report), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report.as_dict(), indent=2) + "\n", encoding="utf-8")
    return 0
