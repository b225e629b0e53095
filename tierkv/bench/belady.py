"""Offline references for the prefix-cache replay: Belady's optimum, a true upper
bound where Belady's greedy is not one, and a brute force to check both.

The replay rule is the one of `tierkv.workloads.traces.prefix_hit_ratio`: a request hits on
its leading run of cached blocks; then its blocks are stored. Blocks are counted by
position, as the replay counts them: a request naming an id twice counts two blocks
(both hit or both miss). An offline reference knows every future request, so after
each request it keeps the blocks whose next use is soonest ("evict the block whose
next use is furthest", Belady 1966). Next use is measured in global access
positions (request order, then position within the request), so on a prefix trace a
parent, which comes before its child in every request holding the child, always
ranks as *sooner* than the child: ties between a chain's blocks go to evicting the
deepest block first.

Two variants, differing only in admission:

* ``bypass=False`` (demand): every block of a request is stored, exactly as the
  replay rule and `PrimaryTier` do (a request's own blocks are protected while it
  is stored; a request that cannot fit is refused whole). Victims are the cached
  blocks of other requests with the furthest next use. The best of *policies that
  admit everything* on prefix-consistent traces.
* ``bypass=True`` (optional caching): after a request the cache keeps the
  `capacity` blocks of (cache ∪ the request's blocks) with the soonest next use, so
  a block whose next use is further than every cached block's is never admitted,
  and a block never used again is never stored.

When Belady is the optimum, and what bounds the rest. Count a hit for *every*
cached block a request names, each distinct id once (any-position hits): then the
greedy "keep the soonest" is optimal by the classic exchange argument, for both
admission models, and every policy's prefix hits are at most its any-position hits.
On a *prefix-consistent* trace (each id always follows the same parent id and no
request repeats an id, as Mooncake's prefix hashes and vLLM's chained block hashes
guarantee) the cache that greedy keeps is prefix-closed: a block's parent is named
in every request that names the block and so is always used sooner; hence every
cached block of a request lies in its leading run, prefix hits equal any-position
hits, and Belady with bypass is the exact optimum of the replay (`exact`).

Where ids follow several parents (content-addressed chunks, as in some RAG
pipelines) or a request repeats an id, that argument fails and the greedy's prefix
hits are *not* an upper bound (LRU can beat them). `reference` then reports, as
the bound, the greedy's any-position hits over distinct ids plus every repeated
position whose id was named by an earlier request (the most a repeat can add): a
true upper bound on the prefix hits of any policy, not necessarily reachable.
`brute_force_hits` checks both claims on small traces (`tests/unit/test_belady.py`).

Numbers on the Mooncake conversation trace (12,031 requests, 288,500 accesses,
prefix-consistent), hit ratio at capacity 1000 / 4000 / 16000 blocks, with LRU's
hit ratio as a fraction of each:

    LRU                     0.0445  0.0853  0.2627
    Belady, bypass=False    0.1792  0.3205  0.3664   LRU/Belady 0.248 0.266 0.717
    Belady, bypass=True     0.1907  0.3223  0.3664   LRU/Belady 0.233 0.265 0.717

The bypass variant is the reference the comparisons use (`tierkv.bench.replay`); the two
differ only at small capacities, where storing a block that will not be used again
costs a block that would (6% more hits at 1000 blocks).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

NEVER = 1 << 62  # the next-use position of a block that is not used again


@dataclass(frozen=True, slots=True)
class BeladyResult:
    hit_blocks: int  # prefix hits (positions): the leading run of cached blocks
    total_blocks: int  # positions
    any_hits: int  # cached blocks anywhere in a request, each distinct id once
    evictions: int  # blocks dropped from the cache, bypassed blocks included
    refused: int  # requests whose store could not fit (bypass=False only)

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


BoundResult = BeladyResult


@dataclass(frozen=True, slots=True)
class Reference:
    """The references of one trace at one capacity (see the module's doc).

    `bound`: what policies are measured against, a true upper bound on prefix hits;
    Belady with bypass when `exact`, else the any-position bound. `greedy`: Belady
    with bypass (prefix hits of that offline schedule, reachable). `demand`: Belady
    storing every block."""

    bound: BeladyResult
    greedy: BeladyResult
    demand: BeladyResult
    exact: bool


def prefix_consistent(requests: Sequence[Sequence[Hashable]]) -> bool:
    """Each id always follows the same parent id (or always starts a request), and
    no request names an id twice."""
    parent: dict[Hashable, Hashable] = {}
    root = object()
    for keys in requests:
        prev: Hashable = root
        for key in keys:
            if parent.setdefault(key, prev) is not prev and parent[key] != prev:
                return False
            prev = key
        if len(set(keys)) != len(keys):
            return False
    return True


def reference(requests: Sequence[Sequence[Hashable]], capacity: int,
              *, exact: bool | None = None) -> Reference:
    """Bound, greedy and demand references at `capacity`. `exact` (computed when
    None) says whether the trace is prefix-consistent."""
    if exact is None:
        exact = prefix_consistent(requests)
    greedy = belady(requests, capacity, bypass=True)
    demand = belady(requests, capacity, bypass=False)
    if exact:
        return Reference(greedy, greedy, demand, True)
    bound_hits = greedy.any_hits + reachable_repeats(requests)
    bound = BeladyResult(max(bound_hits, greedy.hit_blocks), greedy.total_blocks,
                         greedy.any_hits, greedy.evictions, 0)
    return Reference(bound, greedy, demand, False)


def reachable_repeats(requests: Sequence[Sequence[Hashable]]) -> int:
    """Positions that repeat an id earlier in the same request, where the id was
    also named by an earlier request (only those can be hits)."""
    seen: set[Hashable] = set()
    count = 0
    for keys in requests:
        if len(keys) != len(set(keys)):
            mine: set[Hashable] = set()
            for key in keys:
                if key in mine:
                    count += key in seen
                mine.add(key)
        seen.update(keys)
    return count


def next_uses(requests: Sequence[Sequence[Hashable]]) -> list[list[int]]:
    """For each access, the global position of the next access to the same block.

    Co-indexed with `requests`; `NEVER` where the block is not named again. One
    backward pass, O(accesses)."""
    starts = list(itertools.accumulate((len(r) for r in requests), initial=0))
    seen: dict[Hashable, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        row = [NEVER] * len(requests[i])
        for j in range(len(requests[i]) - 1, -1, -1):
            key = requests[i][j]
            row[j] = seen.get(key, NEVER)
            seen[key] = starts[i] + j
        out[i] = row
    return out


def belady(
    requests: Sequence[Sequence[Hashable]], capacity: int, *, bypass: bool = True
) -> BeladyResult:
    """Replay `requests` (each a sequence of block ids) against the offline optimum.

    Decisions are made on each request's distinct ids; hits and totals are counted
    by position, as the replay counts them. O(accesses · log accesses): a max-heap
    of (next use, key) with lazy deletion; an entry is live while it matches the
    key's current next use in `cached`."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    positions = requests
    requests = [list(dict.fromkeys(r)) for r in requests]  # decisions: distinct ids
    nxt = next_uses(requests)
    cached: dict[Hashable, int] = {}  # key -> its next use (live heap entry)
    heap: list[tuple[int, int, Hashable]] = []  # (-next use, tiebreak, key)
    tiebreak = itertools.count()
    hits = any_hits = total = evictions = refused = 0
    for named, keys, uses in zip(positions, requests, nxt, strict=True):
        total += len(named)
        run = 0
        while run < len(named) and named[run] in cached:
            run += 1
        hits += run
        any_hits += sum(1 for k in keys if k in cached)
        if bypass:
            for key, use in zip(keys, uses, strict=True):
                cached[key] = use
                heapq.heappush(heap, (-use, next(tiebreak), key))
            evictions += _shrink(cached, heap, capacity, frozenset())
        else:
            if len(keys) > capacity:
                # The request's own blocks are protected, so it cannot fit: refused
                # whole, as PrimaryTier refuses it.
                refused += 1
                # The hit blocks were loaded (a use): their next use still moves on.
                keep = {k: u for k, u in zip(keys, uses, strict=True) if k in cached}
            else:
                keep = dict(zip(keys, uses, strict=True))
            for key, use in keep.items():
                cached[key] = use
                heapq.heappush(heap, (-use, next(tiebreak), key))
            evictions += _shrink(cached, heap, capacity, frozenset(keep))
    return BeladyResult(hits, total, any_hits, evictions, refused)


def _shrink(
    cached: dict[Hashable, int],
    heap: list[tuple[int, int, Hashable]],
    capacity: int,
    protected: frozenset[Hashable],
) -> int:
    """Evict furthest-next-use keys not in `protected` until `cached` fits."""
    evicted = 0
    held: list[tuple[int, int, Hashable]] = []
    while len(cached) > capacity:
        entry = heapq.heappop(heap)
        key = entry[2]
        if cached.get(key) != -entry[0]:
            continue  # stale: evicted already, or used again since this entry
        if key in protected:
            held.append(entry)
            continue
        del cached[key]
        evicted += 1
    for entry in held:
        heapq.heappush(heap, entry)
    return evicted


def brute_force_hits(
    requests: Sequence[Sequence[Hashable]],
    capacity: int,
    *,
    bypass: bool = True,
    prefix: bool = True,
) -> int:
    """The best achievable hit count, by exhaustive search (tiny traces only).

    After each request every legal next cache is tried: with `bypass`, any subset of
    (cache ∪ the request's blocks) of at most `capacity` blocks; without it, the
    request's blocks plus the cache minus any set of victims from other blocks that
    makes room (or, if the request cannot fit, the cache unchanged). `prefix`
    counts the leading run of cached positions as hits (the replay rule); otherwise
    every cached distinct id a request names counts. Exponential: keep traces to a
    few requests over a handful of blocks."""
    named = [tuple(r) for r in requests]
    requests = [tuple(dict.fromkeys(r)) for r in requests]
    memo: dict[tuple[int, frozenset[Hashable]], int] = {}

    def best(i: int, cache: frozenset[Hashable]) -> int:
        if i == len(requests):
            return 0
        state = (i, cache)
        if state in memo:
            return memo[state]
        keys = requests[i]
        gained = _hits(named[i] if prefix else keys, cache, prefix)
        value = gained + max(best(i + 1, nxt) for nxt in _successors(keys, cache, capacity,
                                                                      bypass))
        memo[state] = value
        return value

    return best(0, frozenset())


def _hits(keys: Sequence[Hashable], cache: frozenset[Hashable], prefix: bool) -> int:
    if not prefix:
        return sum(1 for k in keys if k in cache)
    run = 0
    while run < len(keys) and keys[run] in cache:
        run += 1
    return run


def _successors(
    keys: Sequence[Hashable], cache: frozenset[Hashable], capacity: int, bypass: bool
) -> list[frozenset[Hashable]]:
    if bypass:
        pool = sorted(cache | set(keys), key=repr)
        size = min(capacity, len(pool))
        # Keeping fewer than `size` never helps, so only the largest subsets are tried.
        return [frozenset(c) for c in itertools.combinations(pool, size)]
    others = sorted(cache - set(keys), key=repr)
    new = [k for k in keys if k not in cache]
    room = capacity - len(cache)
    if len(new) - room > len(others):
        return [cache]  # refused whole, as PrimaryTier does
    shortfall = max(0, len(new) - room)
    return [
        cache.union(keys).difference(victims)
        for victims in itertools.combinations(others, shortfall)
    ]
