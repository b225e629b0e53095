"""One engine step's operations (`OpsRequest`), run against the manager in one pass.

The request carries every key of the step in one blob and every section's groups as
counts into it (`tierkv.wire.protocol`); this module splits the blob once (in C),
runs the sections in their fixed order, group by group, and answers with arrays.
A group that fails (a key that is not ready to pin, a block state the manager
refuses) becomes an `OpError` naming its section and index; the other groups run.
Socket-free: `BrokerCore` hands it decoded requests and sends what it returns. It is
built from the parts it works on, not from the core, so it reads (and tests) alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from itertools import accumulate
from typing import Any

import numpy as np

from broker.events import EventRouter
from broker.owners import Owner, OwnerRefused, OwnerTable
from tierkv.core.costs import Recompute, recompute_for
from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.keys import OffloadKey
from tierkv.core.policies.hints import RequestHints, hints_from_kv_hints
from tierkv.core.primary import BlockStateError
from tierkv.core.tiering import HIT, TieringManager
from tierkv.wire.codec import BadRequest
from tierkv.wire.keyblob import pack_keys, unpack_counts, unpack_keys
from tierkv.wire.protocol import (
    KEY_SECTIONS,
    KeyGroups,
    OpError,
    OpsRequest,
    RequestContext,
)

REMEMBERED_CONTEXTS = 100_000  # requests whose context the broker keeps (the oldest go)


class GroupFailed(Exception):
    """One group of a section cannot be done; the message says why."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def new_blocks(primary: Any, keys: Iterable[OffloadKey]) -> int:
    """How many of these (distinct) keys the CPU tier does not hold yet."""
    return sum(not primary.contains(k) for k in keys)


def check_fits(primary: Any, keys: list[OffloadKey], new: int | None = None) -> None:
    """A group of more new blocks than the whole CPU tier has can never be stored,
    however much is evicted: `too_large`, so that the caller splits it rather than
    retrying it as if the tier were only full right now (`refused`). `new`: the
    count, where the caller has it; a group no longer than the tier is never counted."""
    if len(keys) <= primary.num_blocks:
        return
    if new is None:
        new = new_blocks(primary, dict.fromkeys(keys))
    if new > primary.num_blocks:
        raise GroupFailed(ErrorCode.TOO_LARGE,
                          f"{new} new blocks in one group, more than the whole CPU tier "
                          f"holds (cpu.num_blocks = {primary.num_blocks}): split it")


class _Groups:
    """A section's groups: (index, req_id, keys) in order."""

    def __init__(self, groups: KeyGroups, keys: list[OffloadKey], start: int, name: str,
                 owner: Owner):
        self.counts = unpack_counts(groups.counts, f"ops.{name}.counts")
        # Request ids are the owner's own: another client's "r1" is another request.
        self.req_ids = [owner.scope(r) if r else "" for r in groups.req_ids]
        self.keys = keys
        self.offsets = list(accumulate(self.counts, initial=start))
        self.end = self.offsets[-1]

    def __iter__(self) -> Iterator[tuple[int, str | None, list[OffloadKey]]]:
        offsets, keys, req_ids = self.offsets, self.keys, self.req_ids
        for i in range(len(self.counts)):
            yield i, (req_ids[i] or None) if req_ids else None, keys[offsets[i]:offsets[i + 1]]

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def total(self) -> int:
        return self.end - self.offsets[0]


# GPU -> CPU on every rank: (job id, keys accepted, refused); see `BrokerCore.store`.
StoreEntry = Callable[[bytes, list[OffloadKey], list[int], str | None, list[str]],
                      tuple[int | None, list[OffloadKey], bool]]
# CPU -> GPU on every rank: (job id, blocks promoted from each tier); `BrokerCore.load`.
LoadEntry = Callable[[bytes, list[OffloadKey], list[int], str | None, list[str]],
                     tuple[int, dict[str, int]]]


class StepOps:
    """Runs one `OpsRequest`'s sections on the broker's thread; never blocks."""

    def __init__(self, manager: TieringManager, owners: OwnerTable, events: EventRouter,
                 clock: Callable[[], float], region_id: str, store: StoreEntry,
                 load: LoadEntry, counters: dict[str, int]) -> None:
        self.manager = manager
        self.owners = owners
        self.events = events
        self.clock = clock
        self.region_id = region_id  # every reply names it: see `OpsResult.region`
        self.store = store  # transfers need workers, which the core holds
        self.load = load
        self.counters = counters  # the core's, where a refused reservation is counted
        # By the owner's request id, until the request finishes: the context, and
        # the hints the policy reads of it.
        self.contexts: dict[str, tuple[RequestContext, RequestHints | None]] = {}

    def forget(self, prefix: str) -> None:
        """The contexts of an owner that ended."""
        for req_id in [r for r in self.contexts if r.startswith(prefix)]:
            del self.contexts[req_id]

    def run(self, owner: Owner, msg: OpsRequest) -> dict[str, Any]:
        """Run every section; returns the `OpsResult` fields that have answers. The
        whole message is checked before anything is applied: one bad field is a
        ProtocolError naming it, and nothing changed."""
        client = owner.identity
        keys = unpack_keys(msg.keys, msg.key_len, msg.key_lens, "ops.keys")
        sections: dict[str, _Groups] = {}
        at = 0
        for name in KEY_SECTIONS:
            groups = getattr(msg, name)
            if groups is not None:
                sections[name] = _Groups(groups, keys, at, name, owner)
                at = sections[name].end
        contexts = [(owner.scope(c.req_id), c, _hints(c, i)) for i, c in enumerate(msg.contexts)]
        # Every reply names the region: a client tells a restarted broker by it.
        out: dict[str, Any] = {"errors": [], "region": self.region_id}
        manager = self.manager
        errors: list[OpError] = out["errors"]

        def each(name: str, fn: Callable[[int, str | None, list[OffloadKey]], None]) -> None:
            for i, req_id, group in sections[name]:
                try:
                    fn(i, req_id, group)
                except (GroupFailed, OwnerRefused) as e:
                    errors.append(OpError(name, i, e.code.value, str(e)))
                except (BlockStateError, ValueError, TierError) as e:
                    errors.append(OpError(name, i, ErrorCode.BAD_REQUEST.value, str(e)))

        owners = self.owners
        owners.arrivals.name(owner, msg.scope)
        if msg.region and msg.region != self.region_id:
            self._refuse_stale_commits(owner, sections, msg.region, out)
        if "commit" in sections:
            ok = np.frombuffer(msg.commit_ok, dtype=np.uint8)
            each("commit", lambda i, r, g: owners.commit(owner, g, bool(ok[i])))
        if "commit_as" in sections:
            self._commit_as(owner, sections["commit_as"], out)
        if "release" in sections:
            each("release", lambda i, r, g: owners.release(owner, g))
        for req_id, context, hints in contexts:
            self._remember(req_id, context, hints)
        if "lookup" in sections:
            self._lookup(owner, sections["lookup"], msg.lookup_status, msg.lookup_modes,
                         msg.lookup_pin, out, recompute_for(msg.prefill_tps, msg.key_tokens))
        if "pin" in sections:
            self._pin(owner, sections["pin"], out, each)
        if "load" in sections:
            self._load(client, sections["load"], msg.load_gpu, msg.kv_tokens, out, each)
        if "reserve" in sections:
            self._reserve(owner, sections["reserve"], out)
        if "store" in sections:
            self._store(client, sections["store"], msg.store_gpu, msg.kv_tokens, out, each)
        if "touch" in sections:
            manager.touch(keys[sections["touch"].offsets[0]:sections["touch"].end])
        if "queue" in sections:
            manager.waiting([group for _, _, group in sections["queue"]])
        for req_id in msg.finish:
            scoped = owner.scope(req_id)
            manager.finish(scoped)
            self.contexts.pop(scoped, None)
        arrivals = owners.arrivals.count(owner)
        if arrivals is not None:
            out["arrivals"] = arrivals
        return out

    # -- sections ------------------------------------------------------------------------

    def _remember(self, req_id: str, context: RequestContext,
                  hints: RequestHints | None) -> None:
        self.contexts.pop(req_id, None)
        self.contexts[req_id] = (context, hints)
        while len(self.contexts) > REMEMBERED_CONTEXTS:
            del self.contexts[next(iter(self.contexts))]

    def _lookup(self, owner: Owner, groups: _Groups, per_key: bool, modes: bytes, pin: bool,
                out: dict[str, Any], recompute: Recompute | None) -> None:
        """Each group a leading run, or (`per_key`, or its byte of `modes`) each key on
        its own; statuses and sources come back for every key when any group asked.
        `recompute`: what the engine said recomputing costs it (a request's context
        may give its own budget), for the load-or-recompute rule."""
        manager = self.manager
        hits: list[int] = []
        state: list[int] = []
        statuses: list[int] = []
        sources: list[int] = []
        rows: list[int] = []
        contexts = self.contexts
        tier_index = {t.name: i + 1 for i, t in enumerate(manager.tiers)}
        statuses_wanted = per_key or any(modes)
        slower: list[tuple[int, ...]] = []
        for i, req_id, keys in groups:
            known = contexts.get(req_id) if contexts and req_id is not None else None
            allowed, hints = (known[0].tiers, known[1]) if known is not None else (None, None)
            cost = recompute
            if known is not None and known[0].load_budget_s is not None:
                cost = Recompute(recompute.seconds_per_key if recompute else 0.0,
                                 known[0].load_budget_s)
            status: list[int] | None = None
            if modes[i] if modes else per_key:
                found, status = manager.lookup_keys(keys, req_id, allowed, hints, cost)
                statuses.extend(status)
                sources.extend(tier_index.get(manager.source_of(k) or "", 0) if st == HIT
                               else 0 for k, st in zip(keys, status, strict=True))
            else:
                found = manager.lookup(keys, req_id, allowed, hints, cost)
                if statuses_wanted:  # a place for its keys in the arrays, never read
                    statuses.extend([HIT] * found.hits + [0] * (len(keys) - found.hits))
                    sources.extend([0] * len(keys))
            hits.append(found.hits)
            state.append(2 if found.retry else 1 if found.pending else 0)
            slower.append(found.slower)
            if pin:
                rows.extend(self._pin_hits(owner, keys, req_id, found.hits, status))
        out["hits"] = np.asarray(hits, np.int32).tobytes()
        out["state"] = bytes(state)
        if any(slower):
            width = len(manager.tiers)
            out["slower"] = np.asarray([c or (0,) * width for c in slower],
                                       np.int32).tobytes()
            out["tiers"] = [t.name for t in manager.tiers]
        if statuses_wanted:
            out["status"] = bytes(statuses)
            out["sources"] = bytes(sources)
            out["tiers"] = [t.name for t in manager.tiers]
        if pin:
            out["rows"] = np.asarray(rows, np.int32).tobytes()
            out["region"] = self.region_id
            out["pin_s"] = self.owners.pin_s

    def _pin_hits(self, owner: Owner, keys: list[OffloadKey], req_id: str | None, hits: int,
                  status: list[int] | None) -> list[int]:
        """Pin a lookup's hits in the same pass that found them, so no eviction can
        come between the answer and the engine's read: the leading `hits`, or every
        key whose status is HIT. Their block ids, -1 for the other keys."""
        rows = [-1] * len(keys)
        where = (range(hits) if status is None
                 else [i for i, st in enumerate(status) if st == HIT])
        if where:
            pinned = [keys[i] for i in where]
            try:
                self.owners.check_room(owner, len(pinned))
                ids = self.manager.prepare_load(pinned, req_id)
            except (BlockStateError, ValueError, OwnerRefused):
                return rows  # nothing pinned: the hits read as misses
            self.owners.pinned(owner, pinned, self.clock())
            for i, block_id in zip(where, ids, strict=True):
                rows[i] = block_id
        return rows

    def _pin(self, owner: Owner, groups: _Groups, out: dict[str, Any], each: Any) -> None:
        pinned = np.full(groups.total, -1, np.int32)
        base = groups.offsets[0]
        owners = self.owners

        def pin(i: int, req_id: str | None, keys: list[OffloadKey]) -> None:
            owners.check_room(owner, len(keys))
            ids = self.manager.prepare_load(keys, req_id)
            owners.pinned(owner, keys, self.clock())
            start = groups.offsets[i] - base
            pinned[start:start + len(ids)] = ids

        each("pin", pin)
        out["pinned"] = pinned.tobytes()
        out["region"] = self.region_id
        out["pin_s"] = self.owners.pin_s

    def _reserve(self, owner: Owner, groups: _Groups, out: dict[str, Any]) -> None:
        manager, owners, now = self.manager, self.owners, self.clock()
        reserved = np.full(groups.total, -1, np.int32)
        ok = np.zeros(len(groups), np.uint8)
        evicted: list[OffloadKey] = []
        errors: list[OpError] = out["errors"]
        base = groups.offsets[0]
        for i, _req_id, keys in groups:
            start = groups.offsets[i] - base
            where = {k: j for j, k in enumerate(keys)}
            # The owner's own reservations of these keys: renewed, their rows again.
            for key in owners.renew(owner, keys, now):
                row = manager.primary.block_id(key)
                reserved[start + where[key]] = -1 if row is None else row
            try:
                new = new_blocks(manager.primary, where)
                check_fits(manager.primary, keys, new)
                owners.check_room(owner, new)
            except (GroupFailed, OwnerRefused) as e:
                errors.append(OpError("reserve", i, e.code.value, str(e)))
                continue
            result = manager.prepare_store(keys)
            if result is None:
                self.counters["stores_refused"] += 1
                continue
            ok[i] = 1
            evicted.extend(result.evicted_keys)
            if result.keys_to_store:
                owners.reserved(owner, result.keys_to_store, now)
                self.events.own(owner.identity, result.keys_to_store)
                for key, block_id in zip(result.keys_to_store, result.block_ids, strict=True):
                    reserved[start + where[key]] = block_id
        blob, width, lens = pack_keys(evicted)
        out.update(reserved=reserved.tobytes(), reserve_ok=ok.tobytes(), evicted=blob,
                   region=self.region_id,
                   evicted_lens=lens if lens else bytes([width]) * len(evicted))

    def _refuse_stale_commits(self, owner: Owner, sections: dict[str, _Groups], region: str,
                              out: dict[str, Any]) -> None:
        """The engine wrote its rows into a region this broker does not serve (mapped
        before a restart): committing them would serve the new region's stale rows as
        hits. Every commit of the request is refused and its reservation aborted, so
        the rows are freed now rather than at the reservation's deadline."""
        errors: list[OpError] = out["errors"]
        message = (f"rows written into CPU region {region!r}, but this broker serves "
                   f"{self.region_id!r}: map the region again and rewrite them")
        for name in ("commit", "commit_as"):
            groups = sections.pop(name, None)
            if groups is None:
                continue
            for i, _req_id, keys in groups:
                reserved = keys[:len(keys) // 2] if name == "commit_as" else keys
                try:
                    self.owners.commit(owner, reserved, False)
                except (GroupFailed, OwnerRefused, BlockStateError, ValueError):
                    pass  # not this client's reservation (any more): nothing to free
                errors.append(OpError(name, i, ErrorCode.STALE_REGION.value, message))
            if name == "commit_as":
                out["stored_as"] = bytes(groups.total // 2)

    def _commit_as(self, owner: Owner, groups: _Groups, out: dict[str, Any]) -> None:
        """Each group: n reserved keys, then the n keys their rows were written with."""
        stored = np.zeros(groups.total // 2, np.uint8)
        errors: list[OpError] = out["errors"]
        at = 0
        for i, _req_id, keys in groups:
            half = len(keys) // 2
            try:
                if len(keys) % 2:
                    raise GroupFailed(ErrorCode.BAD_REQUEST, f"{len(keys)} keys: a reserved "
                                      "key and the key it was written with, in two halves")
                done = self.owners.commit_as(owner, keys[:half], keys[half:])
            except (GroupFailed, OwnerRefused) as e:
                errors.append(OpError("commit_as", i, e.code.value, str(e)))
            else:
                stored[at:at + half] = done
                self.events.own(owner.identity, [k for k, ok in zip(keys[half:], done,
                                                                         strict=True) if ok])
            at += half
        out["stored_as"] = stored.tobytes()

    def _store(self, client: bytes, groups: _Groups, gpu: bytes, tokens: list[str],
               out: dict[str, Any], each: Any) -> None:
        gpu_ids = np.frombuffer(gpu, dtype="<i4")
        jobs = np.full(len(groups), -1, np.int64)
        refused = np.zeros(len(groups), np.uint8)
        accepted = np.zeros(groups.total, np.uint8)
        base = groups.offsets[0]

        def store(i: int, req_id: str | None, keys: list[OffloadKey]) -> None:
            a, b = groups.offsets[i] - base, groups.offsets[i + 1] - base
            job_id, taken, was_refused = self.store(client, keys, gpu_ids[a:b].tolist(),
                                                         req_id, tokens)
            jobs[i], refused[i] = -1 if job_id is None else job_id, was_refused
            if taken:
                mine = set(taken)
                accepted[a:b] = [k in mine for k in keys]

        each("store", store)
        out.update(store_jobs=jobs.tobytes(), store_refused=refused.tobytes(),
                   store_accepted=accepted.tobytes())

    def _load(self, client: bytes, groups: _Groups, gpu: bytes, tokens: list[str],
              out: dict[str, Any], each: Any) -> None:
        gpu_ids = np.frombuffer(gpu, dtype="<i4")
        jobs = np.full(len(groups), -1, np.int64)
        sources: list[dict[str, int]] = [{} for _ in range(len(groups))]
        base = groups.offsets[0]

        def load(i: int, req_id: str | None, keys: list[OffloadKey]) -> None:
            a, b = groups.offsets[i] - base, groups.offsets[i + 1] - base
            jobs[i], sources[i] = self.load(client, keys, gpu_ids[a:b].tolist(), req_id,
                                                 tokens)

        each("load", load)
        out.update(load_jobs=jobs.tobytes(), load_sources=sources)


def _hints(context: RequestContext, index: int) -> RequestHints | None:
    """The policy's reading of a context, checked before the message does anything."""
    try:
        return request_hints(context)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"ops.contexts[{index}]: {e}") from None


def request_hints(context: RequestContext) -> RequestHints | None:
    """What a request's context says, as the policy reads it: the engine's own fields,
    over what the orchestrator's hints (vLLM's `kv_hints`) say."""
    base = hints_from_kv_hints(context.hints) if context.hints else None
    fields: dict[str, Any] = {
        "session": context.session or None,
        "turn": context.turn if context.turn >= 0 else None,
        "continues": context.continues,
        "expected_next_s": context.next_turn_s,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return base
    return replace(base, **given) if base is not None else RequestHints(**given)
