"""One request's lookups: which of its keys to ask the broker about, and its answers.

vLLM asks about one key at a time, in whatever order its scan goes: a prefix scan
from the first block the GPU lacks, a sliding-window scan from the last block
backwards, a scan that stops at a miss or goes on past keys it was told RETRY. Two
things make any order converge:

* every key vLLM asked and got no answer for is *asked* (`RequestLookups.asks`),
  never overwritten, and the step's end sends them all, so the next step answers
  every key the same scan will ask again;
* a request's first key without an answer in a step may also be looked up at once,
  with the keys its scan will ask next (`chain_for`): the ones after it for a
  full-attention group, the ones before it for a sliding-window group, at most
  `max_keys` of them, so the work of one request in one round trip is bounded.

Answers are per vLLM chunk. A hit was pinned by the broker pass that found it and
stays pinned until vLLM loads it (`prepare_load` claims the pins), or for
`HIT_STEPS` steps; any other answer serves the step it was meant for and is asked
again after (a miss can become a hit when another engine stores it, a pending
block lands). A request waiting in vLLM's queue, or one vLLM was told RETRY for,
is asked again at each step's end whose answers for it expire, until vLLM asks
about it (vLLM does only once it has room for it), and an answer for it that comes
back a step late still serves: its next ask finds one. A queued request's answers
that are not hits serve longer (`QUEUED_STEPS`); a miss among them for a key this
engine has seen stored since is looked up again when vLLM asks. While it is at the
queue's head, its hits are kept without asking again as long as the broker surely
holds their pins (`PIN_TRUSTED` of `broker.pin_s`, which the reply says), and its
misses as long as nothing arrived in its namespace since they were answered (the
reply's `OpsResult.arrivals`, which counts the keys of the namespace the node came to
hold other than by this engine's stores; this engine's own are `_stored_now`), said
by a reply of the last `QUEUED_STEPS` steps.

Full-attention groups are looked up as leading runs (the broker stops promoting at
the first key no tier holds); a model with a sliding-window group is looked up key
by key (its scan needs a status per key), for every group, since the broker takes
one mode per message.

Runs on the scheduler thread, under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, get_offload_group_idx

from tierkv.client import Lookup
from tierkv.vllm.request_keys import request_keys

HIT_STEPS = 4  # steps a hit vLLM did not load stays pinned for its request
# A request in vLLM's queue is looked up again whenever its answers expire, until
# vLLM scans it: its misses serve as long as hits (a miss may go stale meanwhile:
# see `TierkvOffloadingManager.lookup`), so that costs fewer round trips a step.
QUEUED_STEPS = HIT_STEPS
# The share of the broker's pin deadline (`broker.pin_s`) a hit is kept for without
# asking again, while its request waits at the head of vLLM's queue.
PIN_TRUSTED = 0.5
NEVER = 1 << 62  # a step no engine reaches
STATUS = {"hit": LookupResult.HIT, "pending": LookupResult.HIT_PENDING,
          "miss": LookupResult.MISS, "retry": LookupResult.RETRY}
UNPINNED = "unpinned"  # `read_answers`: a hit whose pin was refused (a miss, present)
# Answers that defer the request: asked again at the step's end.
AGAIN = (LookupResult.RETRY, LookupResult.HIT_PENDING)


@dataclass(slots=True)
class Answer:
    """What a chunk is, and what serving it needs: a hit's CPU row is in `region`,
    and the tierkv key pinned for it (claimed by `prepare_load`) is its request's
    (`RequestLookups.rows`). One answer serves every chunk of a reply that has it
    (an engine step reads thousands of chunks back): a hit's differ by row only."""

    status: LookupResult
    until: int  # the last step it may be used in
    source: str | None = None
    region: str = ""
    held_until: float = 0.0  # CLOCK_MONOTONIC: the broker holds its pin at least till then
    # A miss: the reply's `OpsResult.arrivals` (-1: unknown, or not a miss that stays
    # one while nothing arrives).
    arrivals: int = -1


@dataclass(slots=True)
class RequestLookups:
    ctx: ReqContext
    answers: dict[bytes, Answer] = field(default_factory=dict)
    # Per chunk answered a hit: its CPU row. Its tierkv key (the keymap's prefix and
    # the chunk) is pinned for the request until loaded or let go.
    rows: dict[bytes, int] = field(default_factory=dict)
    asks: dict[bytes, None] = field(default_factory=dict)  # asked, no answer yet
    synced: int = -1  # the step of its last lookup of its own
    waiting_since: float | None = None  # told RETRY for want of an answer since then
    pending_since: float | None = None  # told a key is being written or promoted since
    prefetch: Any = None  # the `Call` looking it up since it was added, until waited for
    coming: set[bytes] = field(default_factory=set)  # keys `prefetch` (if out) looks up
    in_flush: Any = None  # the end-of-step `Call` its asked keys last went in
    asked: bool = False  # vLLM has scanned it
    tiered: bool = False  # an answer of it was RETRY or HIT_PENDING: a tier holds a key
    ahead: Any = None  # its chains to look up before vLLM asks, once made
    ahead_keys: frozenset[bytes] = frozenset()  # the keys of `ahead`
    # Every key of `ahead` has an answer, as `_refresh_queue_head` last saw: whatever
    # drops an answer (or changes `ahead`) clears it, so a queue of answered requests
    # is checked in a flag a request, not a set test.
    covered: bool = False
    expires: int = NEVER  # none of its answers expires before this step


class KnownPresent:
    """Keys this engine saw at the node lately (its hits, its finished stores), so a
    store of one of them is skipped without asking: with rows reserved ahead
    (`spares.py`) nobody else would say it is there. Knowledge older than `ttl_s` is
    forgotten (the node may have evicted it since: then a store is skipped that
    was needed, a miss later, never wrong bytes), and so is a key a lookup found
    absent as the first miss of a leading run."""

    def __init__(self, ttl_s: float = 10.0, most: int = 1 << 16) -> None:
        self.ttl_s = ttl_s
        self.most = most
        self._seen: dict[bytes, float] = {}  # oldest first

    def add(self, key: bytes) -> None:
        self.add_all((key,))

    def add_all(self, keys: Iterable[bytes]) -> None:
        # One update in C: a key seen again keeps its place in the order (it may be
        # forgotten sooner than `ttl_s` once `most` are known: a store not skipped).
        seen = self._seen
        seen.update(dict.fromkeys(keys, time.monotonic()))
        while len(seen) > self.most:
            del seen[next(iter(seen))]

    def forget(self, key: bytes) -> None:
        """The node said it does not hold `key` after all (evicted since)."""
        self._seen.pop(key, None)

    def has(self, key: bytes) -> bool:
        when = self._seen.get(key)
        if when is None:
            return False
        if time.monotonic() - when > self.ttl_s:
            del self._seen[key]
            return False
        return True


def chain_for(ctx: ReqContext, key: bytes, answered: Mapping[bytes, object],
              window_groups: frozenset[int], max_keys: int) -> dict[int, list[bytes]]:
    """The keys to look up with `key`, per KV-cache group, in position order: those
    the scan that asked `key` asks next (see the module docstring)."""
    positions = request_keys(ctx)
    at = positions.get(OffloadKey(key))
    if at is None:
        return {get_offload_group_idx(OffloadKey(key)): [key]}
    backwards = get_offload_group_idx(OffloadKey(key)) in window_groups
    picked = [(p, k) for k, p in positions.items()
              if (p <= at if backwards else p >= at) and k not in answered]
    picked.sort()
    picked = picked[-max_keys:] if backwards else picked[:max_keys]
    return by_group(k for _, k in picked)


_TAIL = itemgetter(slice(-4, None))  # an `OffloadKey`'s group bytes


def by_group(keys: Iterable[bytes]) -> dict[int, list[bytes]]:
    """`keys` per KV-cache group, each in the order given. A key ends with its group's
    4 bytes (`OffloadKey`): keys are grouped by those, and vLLM's
    `get_offload_group_idx` is asked once per group, not per key (a request's
    chains were made key by key at ~1.5 us a key)."""
    keys = list(keys)  # the caller's own, as the lists below, are not shared
    if not keys:
        return {}
    if len(set(map(_TAIL, keys))) == 1:  # one group (most models): no loop in Python
        return {get_offload_group_idx(OffloadKey(keys[0])): keys}
    tails: dict[bytes, list[bytes]] = {}
    for key in keys:
        tail = key[-4:]
        chain = tails.get(tail)
        if chain is None:
            chain = tails[tail] = []
        chain.append(key)
    return {get_offload_group_idx(OffloadKey(chain[0])): chain for chain in tails.values()}


def forget_misses(state: RequestLookups) -> dict[bytes, Answer]:
    """Drop a request's answers that are not hits (they hold nothing), to look them
    up again: one of them went stale. Returns them."""
    answers = state.answers
    dropped = {c: a for c, a in answers.items() if a.status is not LookupResult.HIT}
    state.covered = state.covered and not dropped
    for chunk in dropped:
        del answers[chunk]
    return dropped


def head_first(keys: Iterable[bytes], ctx: ReqContext) -> list[bytes]:
    """`keys` in the request's order, first block first (vLLM's public getter; an
    `OffloadKey` is a `bytes`, so the getter is the sort key itself, one call a key).
    A key vLLM gave no position sorts first."""
    keys = list(keys)
    try:
        return sorted(keys, key=ctx.get_offload_key_position)  # type: ignore[arg-type]
    except TypeError:  # None against a position
        return sorted(keys, key=lambda k: ctx.get_offload_key_position(OffloadKey(k)) or 0)


def asked_chains(state: RequestLookups) -> dict[int, list[bytes]]:
    """A request's asked keys, per group, in position order."""
    return by_group(head_first(state.asks, state.ctx))


def hits_in(answers: Sequence[Answer | None], region: str) -> bool:
    """Whether every one of `answers` is a hit in `region`: each distinct answer
    checked once (a reply's hits share one, so a load of hundreds of chunks checks
    a few objects; the dedup is by identity, in C)."""
    distinct = dict(zip(map(id, answers), answers, strict=True)).values()
    return all(a is not None and a.status is LookupResult.HIT and a.region == region
               for a in distinct)


def defers(found: Lookup | None, chunks: int) -> bool:
    """Whether any of a lookup's answers (`read_answers`) is RETRY or HIT_PENDING,
    read off the reply rather than walking its answers (a request's hits come first,
    hundreds of them)."""
    if found is None:
        return False
    if found.statuses is None:
        return found.hits < chunks and (found.pending or found.retry)
    return "retry" in found.statuses or "pending" in found.statuses


def read_answers(chain: Sequence[bytes], found: Lookup | None, until: int,
                 asked_at: float, hits_until: int | None = None
                 ) -> tuple[dict[bytes, Answer], dict[bytes, int]]:
    """Per chunk of `chain`, its answer, served until step `until` (a hit until
    `hits_until`, if given); and per chunk the broker pinned, its CPU row. `found`
    None: the lookup failed, every chunk a miss. `asked_at`: when the lookup was
    made, before the broker pinned anything. Answers are shared: one per status
    (per source for hits), so a reply of hundreds of hits makes a few objects."""
    if found is None:
        return dict.fromkeys(chain, Answer(LookupResult.MISS, until)), {}
    shared: dict[tuple[str, str | None], Answer] = {}
    held = until if hits_until is None else hits_until
    held_until = asked_at + found.pin_s * PIN_TRUSTED
    # A miss stays one while nothing arrives at the node; not one of a key a slower
    # tier holds (whether to promote it is weighed again at each lookup).
    arrivals = found.arrivals if found.region and not found.slower else -1

    def answer(name: str, source: str | None = None) -> Answer:
        # Keyed by the status's name: an enum member's hash is a Python call.
        found_answer = shared.get((name, source))
        if found_answer is None:
            found_answer = shared[name, source] = (
                Answer(LookupResult.HIT, held, source, found.region, held_until)
                if name == "hit" else
                Answer(LookupResult.MISS, until, region=found.region, arrivals=arrivals)
                if name == "miss" else
                # A hit whose pin was refused: present, so no miss that stays one.
                Answer(LookupResult.MISS, until) if name == UNPINNED
                else Answer(STATUS[name], until))
        return found_answer

    rows = found.rows or [-1] * len(chain)
    # A hit whose pin was refused (the owner's share) reads as a miss.
    if found.statuses is None:  # a leading run: its hits, then one answer for the rest
        hits = found.hits
        lead, lead_rows = chain[:hits], rows[:hits]
        if not hits or min(lead_rows) >= 0:  # every hit pinned: dicts built in C
            answers = dict.fromkeys(lead, answer("hit"))
            pinned = dict(zip(lead, lead_rows, strict=True))
        else:
            answers, pinned = {}, {}
            for chunk, row in zip(lead, lead_rows, strict=True):
                answers[chunk] = answer("hit" if row >= 0 else UNPINNED)
                if row >= 0:
                    pinned[chunk] = row
        if hits < len(chain):
            answers.update(dict.fromkeys(
                chain[hits:], answer("retry" if found.pending or found.retry else "miss")))
        return answers, pinned
    sources = found.sources or [None] * len(chain)
    answers, pinned = {}, {}
    for chunk, status, row, source in zip(chain, found.statuses, rows, sources, strict=True):
        if status == "hit" and row >= 0:
            answers[chunk] = answer("hit", source)
            pinned[chunk] = row
        else:
            answers[chunk] = answer(UNPINNED if status == "hit" else status)
    return answers, pinned
