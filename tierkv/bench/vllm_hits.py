"""Block hit ratios inside vLLM's own CPU offloading manager, next to `tierkv replay`.

Three kinds of row, on one trace at one capacity:

* `vllm`: vLLM's built-in policies (lru, arc) in its `CPUOffloadingManager`;
* `tierkv-in-vllm`: each tierkv policy, plugged into that same manager through
  `tierkv.vllm.policies` (what a vLLM user gets with no tierkv process);
* `tierkv-replay`: the same policy in `tierkv replay` (tierkv's own `PrimaryTier`, a
  prefix stored and used head first).

The first row is the baseline: every tierkv policy inside vLLM should hit at least
as often as vLLM's LRU (`tests/vllm/test_policies.py`). Inside vLLM a prefix is
stored and used tail first, as vLLM's LRU ranks it (`tierkv.vllm.policies`), so the
last two rows differ where that order matters. Two workloads: a trace (Mooncake's
conversation trace by default), and `shared_prefix_stream`, a shared prefix between
one-off requests, where keeping a prefix's head longer than its tail is the whole
difference. The manager is driven the way vLLM's OffloadingConnector
scheduler drives it, simplified to one request at a time with transfers that
complete at once: a lookup per key up to the first miss, a load of the hits, a
store of the rest (prefix hits are not stored again, vLLM's chunk-level
offloading), then the request's end. A block is one trace block (512 tokens in
Mooncake), one KV cache group. `main` prints the table:
`python -m tierkv.bench.vllm_hits --trace PATH --blocks 4000`.

vLLM is imported only when a run starts, so `tierkv bench` can import this module
without it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tierkv.bench.replay import replay
from tierkv.core.policies import known_policies
from tierkv.workloads.traces import (
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_TRACE,
    Request,
    block_key,
    read_trace,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

VLLM = "vllm"
IN_VLLM = "tierkv-in-vllm"
REPLAY = "tierkv-replay"
VLLM_POLICIES = ("lru", "arc")
#: The module vLLM is told to load tierkv's policy classes from.
POLICY_MODULE = "tierkv.vllm.policies"
#: The issue's goal: tierkv's best policy inside vLLM against vLLM's LRU, on the
#: Mooncake conversation trace with a CPU cache of GOAL_BLOCKS blocks.
GOAL_RATIO = 1.7
GOAL_BLOCKS = 4000


@dataclass(frozen=True, slots=True)
class HitRow:
    """One policy's block hits on a trace at one capacity."""

    engine: str  # VLLM, IN_VLLM or REPLAY
    policy: str  # vLLM's name for VLLM rows, tierkv's registry name otherwise
    capacity: int
    hit_blocks: int
    total_blocks: int

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def label(self) -> str:
        return f"{self.engine} {self.policy}"


def vllm_hits(
    requests: Sequence[Request],
    capacity: int,
    cache_policy: str,
    module_path: str | None = None,
) -> tuple[int, int]:
    """(hit blocks, requested blocks) of `requests` through a fresh
    `CPUOffloadingManager` of `capacity` chunks with vLLM's `cache_policy`
    (`"lru"`, or `"TierkvHistARC"` with `module_path=POLICY_MODULE`)."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(
        num_chunks=capacity, cache_policy=cache_policy, cache_policy_module_path=module_path
    )
    policy = getattr(manager, "_policy", None)
    now = 0.0
    if policy is not None and hasattr(policy, "clock"):
        policy.clock = lambda: now  # the trace's clock, as `tierkv replay` uses it
    hits = total = 0
    for serial, request in enumerate(requests):
        now = request.timestamp_ms / 1000.0
        hits += serve_request(manager, request, f"req-{serial}")
        total += len(request.hash_ids)
    return hits, total


def serve_request(manager: CPUOffloadingManager, request: Request, req_id: str) -> int:
    """One request through `manager` in the scheduler's call order; returns its hits.

    The load completes before the store is offered, as with vLLM's default
    asynchronous loads (a request computes, and so stores, only once its load is
    done); the store completes before the next request arrives. Completions get the
    job's keys as a set, as vLLM's scheduler passes them (its jobs hold key sets).
    """
    from vllm.v1.kv_offload.base import ReqContext

    keys = request_keys(request)
    ctx = ReqContext(req_id=req_id)
    # The scheduler records each key's end token so managers can order a request's
    # keys head to tail whatever order the calls come in.
    for index, key in enumerate(keys):
        ctx.set_offload_key_position(key, (index + 1) * MOONCAKE_BLOCK_TOKENS)
    manager.on_new_request(ctx)
    hits = leading_hits(manager, keys, ctx)
    if hits:
        manager.prepare_load(keys[:hits], ctx)
        manager.complete_load(set(keys[:hits]), ctx)
    if hits < len(keys):
        out = manager.prepare_store(keys[hits:], ctx)
        if out is not None and out.keys_to_store:
            manager.complete_store(set(out.keys_to_store), ctx)
    manager.on_request_finished(ctx)
    return hits


def shared_prefix_stream(rounds: int = 10, prefix: int = 8, own: int = 16,
                         one_off: int = 24) -> list[Request]:
    """A shared `prefix`-block prefix (with `own` blocks of its own each time) between
    one-off requests of `one_off` blocks. At `prefix + own + one_off - prefix` blocks
    of cache (32 by default) only a policy that keeps a prefix's head longer than its
    tail hits: a lookup stops at the first miss."""
    unique = iter(range(1 << 20, 1 << 21))
    out: list[Request] = []
    for i in range(rounds):
        own_ids = tuple(next(unique) for _ in range(own))
        out.append(Request(float(2 * i), MOONCAKE_BLOCK_TOKENS * (prefix + own), 1,
                           (*range(prefix), *own_ids)))
        out.append(Request(float(2 * i + 1), MOONCAKE_BLOCK_TOKENS * one_off, 1,
                           tuple(next(unique) for _ in range(one_off))))
    return out


SHARED_PREFIX_BLOCKS = 32  # the cache size the shared-prefix stream is made for


def request_keys(request: Request) -> list[OffloadKey]:
    """vLLM's offload keys of a trace request: block hash + KV group 0."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(block_key(h), 0) for h in request.hash_ids]


def leading_hits(
    manager: CPUOffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext
) -> int:
    """The scheduler's maximal-prefix lookup: keys up to the first non-hit."""
    from vllm.v1.kv_offload.base import LookupResult

    hits = 0
    for key in keys:
        if manager.lookup(key, ctx) is not LookupResult.HIT:
            break
        hits += 1
    return hits


def hit_rows(
    requests: Sequence[Request],
    capacity: int,
    policies: Sequence[str] | None = None,
    *,
    with_replay: bool = True,
) -> list[HitRow]:
    """vLLM's lru and arc, then each tierkv policy (all registered by default) inside
    vLLM's manager and, with `with_replay`, in `tierkv replay`."""
    from tierkv.vllm.policies import class_name

    names = list(policies) if policies is not None else known_policies()
    rows = [HitRow(VLLM, name, capacity, *vllm_hits(requests, capacity, name))
            for name in VLLM_POLICIES]
    for name in names:
        rows.append(HitRow(IN_VLLM, name, capacity,
                           *vllm_hits(requests, capacity, class_name(name), POLICY_MODULE)))
        if with_replay:
            result = replay(requests, capacity, name)
            rows.append(HitRow(REPLAY, name, capacity, result.hit_blocks, result.total_blocks))
    return rows


def baseline(rows: Sequence[HitRow]) -> HitRow | None:
    """vLLM's LRU row, the baseline of the ratios."""
    return next((r for r in rows if r.engine == VLLM and r.policy == "lru"), None)


def best_in_vllm(rows: Sequence[HitRow]) -> HitRow | None:
    """The tierkv policy with the highest hit ratio inside vLLM."""
    return max((r for r in rows if r.engine == IN_VLLM), key=lambda r: r.hit_ratio, default=None)


def format_rows(rows: Sequence[HitRow]) -> str:
    """A table: hit ratio and its ratio to vLLM's LRU, per row, and the goal line."""
    base = baseline(rows)
    lines = [f"{'engine':<16}{'policy':<10}{'blocks':>8}{'hit ratio':>11}{'x vLLM lru':>12}"
             f"{'hits / lookups':>22}", "-" * 79]
    for r in rows:
        times = f"{r.hit_ratio / base.hit_ratio:12.2f}" if base and base.hit_ratio else " " * 12
        lines.append(f"{r.engine:<16}{r.policy:<10}{r.capacity:>8,}{r.hit_ratio:11.4f}{times}"
                     f"{f'{r.hit_blocks:,} / {r.total_blocks:,}':>22}")
    best = best_in_vllm(rows)
    if base and best and base.hit_ratio:
        ratio = best.hit_ratio / base.hit_ratio
        line = f"best tierkv policy in vLLM: {best.policy}, {ratio:.2f}x vLLM's LRU"
        if best.capacity == GOAL_BLOCKS:
            verdict = "meets" if ratio >= GOAL_RATIO else "misses"
            line += f" ({verdict} the goal of {GOAL_RATIO}x at {GOAL_BLOCKS:,} blocks)"
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tierkv.bench.vllm_hits",
        description="Hit ratios inside vLLM's CPU offloading manager: vLLM's policies, "
                    "tierkv's policies plugged into it, and tierkv replay.")
    parser.add_argument("--trace", type=Path, default=MOONCAKE_TRACE,
                        help="Mooncake-format JSONL trace (default: %(default)s)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4000],
                        help="CPU cache sizes in blocks (default: 4000)")
    parser.add_argument("--policies", nargs="+", default=None,
                        help="tierkv policies (default: every registered one)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="the shared-prefix stream (shared_prefix_stream) instead of a "
                             f"trace, at {SHARED_PREFIX_BLOCKS} blocks unless --blocks says")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if any(b <= 0 for b in args.blocks):
        raise SystemExit("vllm_hits: --blocks must be positive")
    unknown = sorted(set(args.policies or ()) - set(known_policies()))
    if unknown:
        raise SystemExit(f"vllm_hits: unknown tierkv policies {', '.join(unknown)}; "
                         f"known: {', '.join(known_policies())}")
    if args.shared_prefix:
        requests, name = shared_prefix_stream(), "shared-prefix stream"
        if args.blocks == [4000]:
            args.blocks = [SHARED_PREFIX_BLOCKS]
    elif not args.trace.exists():
        raise SystemExit(f"vllm_hits: trace {args.trace} not found")
    else:
        requests, name = read_trace(args.trace, args.limit), args.trace.name
    print(f"{name}: {len(requests):,} requests, "
          f"{sum(len(r.hash_ids) for r in requests):,} block lookups")
    for blocks in args.blocks:
        print()
        print(format_rows(hit_rows(requests, blocks, args.policies)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
