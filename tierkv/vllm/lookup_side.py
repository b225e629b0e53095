"""The manager's lookup side: vLLM's `lookup` of a key, answered within the step's
budget from what the broker said, and the round trips that ask the broker ahead
(a new request's `prefetch`, the head of vLLM's queue at each step's end) and take
its answers. `manager.py`'s docstring says when a request is looked up and why.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.client import RemoteError
from tierkv.vllm.lookups import (
    AGAIN,
    HIT_STEPS,
    QUEUED_STEPS,
    Answer,
    RequestLookups,
    by_group,
    chain_for,
    defers,
    forget_misses,
    read_answers,
)
from tierkv.vllm.manager_state import ManagerState
from tierkv.vllm.request_keys import request_keys
from tierkv.vllm.rounds import Carried, Metrics


class LookupSide(ManagerState):
    """Lookups and their round trips (see the module docstring)."""

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        state = self._state(req_context)
        answer = state.answers.get(key)
        if answer is None or answer.until < self._step:
            self.rounds.catch_up()
            answer = state.answers.get(key)
            if answer is None or answer.until < self._step:
                answer = self._answer_now(state, key)
        elif answer.status is LookupResult.MISS and self.present.has(self.keymap.key(key)):
            answer = self._answer_again(state, key, answer)
        if not state.asked:  # queued until now (an answer it waited for above serves)
            state.asked = True
            self._queued.pop(req_context.req_id, None)
        if answer is None:
            now = time.monotonic()
            if state.waiting_since is None:
                state.waiting_since = now
            elif now - state.waiting_since > self.options.lookup_wait_ms / 1e3:
                return LookupResult.MISS  # the broker is slow: computing beats waiting
            state.asks[key] = None
            return LookupResult.RETRY
        state.waiting_since = None
        if answer.status not in AGAIN:
            return answer.status
        # Since vLLM was first told to wait for a block (another key's hit does not
        # end that: its scan asks every key up to this one at each step).
        now = time.monotonic()
        if state.pending_since is None:
            state.pending_since = now
        elif now - state.pending_since > self.options.pending_wait_ms / 1e3:
            # Written by an engine that stopped (the broker ends it only after
            # `broker.owner_timeout_s`) or promoted from a slow tier: computing beats
            # waiting longer.
            return LookupResult.MISS
        state.asks[key] = None
        return answer.status

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        state = self._requests.get(req_context.req_id)
        answer = state.answers.get(key) if state is not None else None
        return self.tiers.hit_source(answer.source if answer is not None else None)

    def _answer_again(self, state: RequestLookups, key: bytes, stale: Answer) -> Answer:
        """A miss this engine has seen stored since it was answered (a queued request's
        answers serve steps): the request's answers that are not hits are dropped
        (they hold nothing, and are as old) and looked up now if the step's budget
        allows; otherwise they stand (computed, never a step of waiting). A miss
        again: the node evicted it since, and it is no longer known present."""
        dropped = forget_misses(state)
        answer = self._answer_now(state, key)
        if answer is None:
            state.answers.update(dropped)
            return stale
        if answer.status is LookupResult.MISS:
            self.present.forget(self.keymap.key(key))
        return answer

    def _answer_now(self, state: RequestLookups, key: bytes) -> Answer | None:
        """An answer this step can give without going past its budget, or None."""
        if self.rounds.down:
            return Answer(LookupResult.MISS, self._step)
        prefetch, state.prefetch = state.prefetch, None
        if prefetch is not None and self.rounds.wait(prefetch, abandon=False):
            self.rounds.catch_up()
            answer = state.answers.get(key)
            if answer is not None and answer.until >= self._step:
                return answer
        flush = self.rounds.flush
        if flush is not None and state.in_flush is flush and not self._flush_waited:
            self._flush_waited = True  # it carries this request's asked keys
            if self.rounds.wait(flush, abandon=False):
                self.rounds.catch_up()
                answer = state.answers.get(key)
                if answer is not None and answer.until >= self._step:
                    return answer
        if self._sync_left <= 0 or state.synced == self._step or not self.rounds.can_wait():
            return None
        self._sync_left -= 1
        state.synced = self._step
        chains = chain_for(state.ctx, key, state.answers, self.window_groups,
                           self.options.max_lookup_keys)
        call = self.rounds.send(self._lookups(
            [(state.ctx.req_id, g, c) for g, c in chains.items()], until=self._step))
        if not self.rounds.wait(call):
            return None
        self.rounds.apply(call)
        answer = state.answers.get(key)
        return answer if answer is not None and answer.until >= self._step else None

    def prefetch(self, ctx: ReqContext) -> None:
        """Look a new request's keys up now, before vLLM asks (it adds requests between
        steps): the answers are there, or on their way, when its first scan comes, so
        it is admitted in the step that first asks for it. Every key from the first,
        per group; pins of hits vLLM's own prefix cache makes needless go after
        `HIT_STEPS`. At most `prefetch_requests` are out at once: a long queue added
        at once must not start promotions (and evictions) for requests that will not
        run for many steps; those are looked up when the step scans them. A request
        that waits in vLLM's queue (it runs once a running one makes room, often steps
        later) has its answers kept fresh while it is among the first
        `prefetch_requests` of the queue (`_refresh_queue_head`)."""
        self._queued[ctx.req_id] = ctx
        if self.rounds.down or len(self.rounds.prefetches) >= self.options.prefetch_requests:
            return
        state = self._state(ctx)
        picked = self._chains_ahead(state)
        if picked:
            state.prefetch = self.rounds.prefetch(self._lookups(picked, until=self._step,
                                                                owed=False))
            state.coming = {k for _, _, keys in picked for k in keys}

    def _chains_ahead(self, state: RequestLookups) -> list[tuple[str, int, list[bytes]]]:
        """A request's keys to look up before vLLM asks: from its first, per group, at
        most `max_lookup_keys` (a sliding-window group's last ones)."""
        if state.ahead is not None:
            return state.ahead
        ctx = state.ctx
        positions = request_keys(ctx)
        most = self.options.max_lookup_keys
        picked = []
        for group, chain in by_group(positions).items():
            chain.sort(key=positions.__getitem__)
            chain = chain[-most:] if group in self.window_groups else chain[:most]
            picked.append((ctx.req_id, group, chain))
        state.ahead = picked
        state.ahead_keys = frozenset(k for _, _, keys in picked for k in keys)
        return picked

    def _refresh_queue_head(self, until: int) -> None:
        """Look up again, in a round trip of their own, the keys without an answer for
        step `until` of the first `prefetch_requests` requests in vLLM's queue: vLLM
        asks about them once running requests make room (often many in one step), and
        they are answered in the step that asks. With them, the misses of a request
        whose keys this engine stored in the step (its misses serve steps, and many
        requests share a prefix). Not a request a slower tier serves
        (its blocks are being promoted, or were): each look-up would start its
        promotions again, and a CPU tier too small for the queue would evict blocks
        promoted for one queued request to promote another's."""
        stored_now, self._stored_now = self._stored_now, set()
        if self.rounds.down:
            return
        stale: list[tuple[RequestLookups, set[bytes]]] = []
        chains = []
        for ctx in islice(self._queued.values(), self.options.prefetch_requests):
            state = self._state(ctx)
            if state.tiered:
                continue  # looked up again, it would start promotions for it again
            if state.covered and (not stored_now or stored_now.isdisjoint(state.ahead_keys)):
                continue  # answered, and none of its keys stored now: the common case
            answers = state.answers
            ahead = self._chains_ahead(state)
            if stored_now and not stored_now.isdisjoint(state.ahead_keys):
                forget_misses(state)  # a miss of it may be one this engine just stored
            if answers.keys() >= state.ahead_keys:
                state.covered = True  # every key answered (a subset test in C)
                continue
            # Keys of its last look-up still on their way are not asked twice.
            coming = state.coming if state.prefetch is not None and not state.prefetch.done \
                else ()
            missing = [(req_id, group, lacking) for req_id, group, chain in ahead
                       if (lacking := [k for k in chain if k not in answers
                                       and k not in coming])]
            if missing:
                stale.append((state, {k for _, _, keys in missing for k in keys} | set(coming)))
                chains.extend(missing)
        if chains:
            call = self.rounds.prefetch(self._lookups(chains, until=until, owed=False))
            for state, keys in stale:
                state.prefetch, state.coming = call, keys

    def _lookups(self, chains: Iterable[tuple[str, int, list[bytes]]], until: int,
                 step: bool = False, owed: bool = True) -> tuple[Any, Carried]:
        """A round trip of lookups (their answers serve through step `until`)."""
        batch, carried = self.rounds.open(self.generation, step, owed)
        for req_id, group, chain in chains:
            # Sliding-window groups key by key; full attention a leading run, whose
            # promotions stop at its first miss.
            batch.lookup(self.keymap.keys(chain), req_id, status=group in self.window_groups,
                         pin=True)
            carried.lookups.append((req_id, chain, until))
        return batch, carried

    def _take_lookups(self, carried: Carried, results: Sequence[Any] | None,
                      told: bool) -> None:
        """A call's lookup answers: kept for their requests if `told` (the call was
        waited for, or is the step's own round trip), still of this generation and
        not out of date; otherwise their pins are let go at once."""
        keymap = self._keymap_of(carried.generation)
        at = carried.owed_slots
        for i, (req_id, chain, until) in enumerate(carried.lookups):
            found = results[at + i] if results is not None else None
            if isinstance(found, RemoteError):
                self._warn.warning("lookup", "tierkv refused a lookup: %s", found)
                found = None
            if found is not None and found.region and found.region != self.spares.region:
                self.spares.drop_all()  # another region: the broker restarted, they are void
                self.spares.region = found.region
            state = self._requests.get(req_id)
            if until < self._step and state is not None and (
                    req_id in self._queued or self._deferred(state)):
                until = self._step  # late, but the freshest there is for it
            # A queued request's misses serve as long as its hits: it is looked up
            # again whenever its answers expire, until vLLM scans it.
            served = until + QUEUED_STEPS - 1 if req_id in self._queued else until
            answers, rows = read_answers(chain, found, served, carried.opened,
                                         hits_until=until + HIT_STEPS - 1)
            pins = keymap.keys(rows)
            self.holdings.pinned(pins)
            if (not told or state is None or carried.generation != self.generation
                    or until < self._step):
                self.holdings.release(pins)
                continue
            self.rounds.stats.increase_counter(Metrics.LOOKUP_KEYS, len(chain))
            kept, asks = state.answers, state.asks
            if kept:  # answers replaced: their pins go (a set operation, in C)
                self._unpin(state, kept.keys() & answers.keys())
            kept.update(answers)
            state.rows.update(rows)
            if asks:
                for chunk in asks.keys() & answers.keys():
                    del asks[chunk]
            self.present.add_all(pins)
            state.tiered = state.tiered or defers(found, len(chain))
            state.expires = min(state.expires, served)
            self.rounds.stats.increase_counter(Metrics.HIT_KEYS, len(pins))
