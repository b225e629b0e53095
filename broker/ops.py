"""One engine step's operations (`OpsRequest`), run against the manager in one pass.

The request carries every key of the step in one blob and every section's groups as
counts into it (`tierkv.wire.protocol`); this module splits the blob once (in C),
runs the sections in their fixed order, group by group, and answers with arrays.
A group that fails (a key that is not ready to pin, a block state the manager
refuses) becomes an `OpError` naming its section and index; the other groups run.
Socket-free: `BrokerCore` hands it decoded requests and sends what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import numpy as np

from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.keys import OffloadKey
from tierkv.core.policies.hints import RequestHints, hints_from_kv_hints
from tierkv.core.primary import BlockStateError
from tierkv.core.tiering import HIT
from tierkv.wire.keyblob import pack_keys, unpack_counts, unpack_keys
from tierkv.wire.protocol import KEY_SECTIONS, KeyGroups, OpError, OpsRequest, RequestContext

if TYPE_CHECKING:
    from broker.core import BrokerCore

MAX_CONTEXTS = 100_000  # requests with context the broker remembers (the oldest go)


class GroupFailed(Exception):
    """One group of a section cannot be done; the message says why."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Groups:
    """A section's groups: (index, req_id, keys) in order."""

    def __init__(self, groups: KeyGroups, keys: list[OffloadKey], start: int, name: str):
        self.counts = unpack_counts(groups.counts, f"ops.{name}.counts")
        self.req_ids = groups.req_ids
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


class StepOps:
    def __init__(self, core: BrokerCore) -> None:
        self.core = core
        self.contexts: dict[str, RequestContext] = {}  # until the request finishes

    def run(self, client: bytes, msg: OpsRequest) -> dict[str, Any]:
        """Run every section; returns the `OpsResult` fields that have answers."""
        keys = unpack_keys(msg.keys, msg.key_len, msg.key_lens, "ops.keys")
        sections: dict[str, _Groups] = {}
        at = 0
        for name in KEY_SECTIONS:
            groups = getattr(msg, name)
            if groups is not None:
                sections[name] = _Groups(groups, keys, at, name)
                at = sections[name].end
        out: dict[str, Any] = {"errors": []}
        manager = self.core.manager
        errors: list[OpError] = out["errors"]

        def each(name: str, fn: Callable[[int, str | None, list[OffloadKey]], None]) -> None:
            for i, req_id, group in sections[name]:
                try:
                    fn(i, req_id, group)
                except GroupFailed as e:
                    errors.append(OpError(name, i, e.code.value, str(e)))
                except (BlockStateError, ValueError, TierError) as e:
                    errors.append(OpError(name, i, ErrorCode.BAD_REQUEST.value, str(e)))

        if "commit" in sections:
            ok = np.frombuffer(msg.commit_ok, dtype=np.uint8)
            each("commit", lambda i, r, g: manager.complete_store(g, bool(ok[i])))
        if "release" in sections:
            each("release", lambda i, r, g: manager.complete_load(g))
        for context in msg.contexts:
            self._remember(context)
        if "lookup" in sections:
            self._lookup(sections["lookup"], msg.lookup_status, msg.lookup_pin, out)
        if "pin" in sections:
            self._pin(sections["pin"], out, each)
        if "load" in sections:
            self._load(client, sections["load"], msg.load_gpu, out, each)
        if "reserve" in sections:
            self._reserve(client, sections["reserve"], out)
        if "store" in sections:
            self._store(client, sections["store"], msg.store_gpu, out, each)
        if "touch" in sections:
            manager.touch(keys[sections["touch"].offsets[0]:sections["touch"].end])
        if "queue" in sections:
            manager.waiting([group for _, _, group in sections["queue"]])
        for req_id in msg.finish:
            manager.finish(req_id)
            self.contexts.pop(req_id, None)
        return out

    # -- sections ------------------------------------------------------------------------

    def _remember(self, context: RequestContext) -> None:
        self.contexts.pop(context.req_id, None)
        self.contexts[context.req_id] = context
        while len(self.contexts) > MAX_CONTEXTS:
            del self.contexts[next(iter(self.contexts))]

    def _lookup(self, groups: _Groups, per_key: bool, pin: bool, out: dict[str, Any]) -> None:
        manager = self.core.manager
        hits: list[int] = []
        state: list[int] = []
        statuses: list[int] = []
        sources: list[int] = []
        rows: list[int] = []
        contexts = self.contexts
        tier_index = {t.name: i + 1 for i, t in enumerate(manager.tiers)}
        for _, req_id, keys in groups:
            context = contexts.get(req_id) if contexts and req_id is not None else None
            allowed = context.tiers if context is not None else None
            hints = request_hints(context) if context is not None else None
            status: list[int] | None = None
            if per_key:
                found, status = manager.lookup_keys(keys, req_id, allowed, hints)
                statuses.extend(status)
                sources.extend(tier_index.get(manager.source_of(k) or "", 0) if st == HIT
                               else 0 for k, st in zip(keys, status, strict=True))
            else:
                found = manager.lookup(keys, req_id, allowed, hints)
            hits.append(found.hits)
            state.append(2 if found.retry else 1 if found.pending else 0)
            if pin:
                rows.extend(self._pin_hits(keys, req_id, found.hits, status))
        out["hits"] = np.asarray(hits, np.int32).tobytes()
        out["state"] = bytes(state)
        if per_key:
            out["status"] = bytes(statuses)
            out["sources"] = bytes(sources)
            out["tiers"] = [t.name for t in manager.tiers]
        if pin:
            out["rows"] = np.asarray(rows, np.int32).tobytes()
            out["region"] = self.core.region_id

    def _pin_hits(self, keys: list[OffloadKey], req_id: str | None, hits: int,
                  status: list[int] | None) -> list[int]:
        """Pin a lookup's hits in the same pass that found them, so no eviction can
        come between the answer and the engine's read: the leading `hits`, or every
        key whose status is HIT. Their block ids, -1 for the other keys."""
        rows = [-1] * len(keys)
        where = (range(hits) if status is None
                 else [i for i, st in enumerate(status) if st == HIT])
        if where:
            try:
                ids = self.core.manager.prepare_load([keys[i] for i in where], req_id)
            except (BlockStateError, ValueError):  # nothing pinned: the hits read as misses
                return rows
            for i, block_id in zip(where, ids, strict=True):
                rows[i] = block_id
        return rows

    def _pin(self, groups: _Groups, out: dict[str, Any], each: Any) -> None:
        pinned = np.full(groups.total, -1, np.int32)
        base = groups.offsets[0]

        def pin(i: int, req_id: str | None, keys: list[OffloadKey]) -> None:
            ids = self.core.manager.prepare_load(keys, req_id)
            start = groups.offsets[i] - base
            pinned[start:start + len(ids)] = ids

        each("pin", pin)
        out["pinned"] = pinned.tobytes()
        out["region"] = self.core.region_id

    def _reserve(self, client: bytes, groups: _Groups, out: dict[str, Any]) -> None:
        manager = self.core.manager
        reserved = np.full(groups.total, -1, np.int32)
        ok = np.zeros(len(groups), np.uint8)
        evicted: list[OffloadKey] = []
        base = groups.offsets[0]
        for i, _req_id, keys in groups:
            result = manager.prepare_store(keys)
            if result is None:
                self.core.counters["stores_refused"] += 1
                continue
            ok[i] = 1
            evicted.extend(result.evicted_keys)
            if result.keys_to_store:
                self.core.events.own(client, result.keys_to_store)
                where = {k: j for j, k in enumerate(keys)}
                start = groups.offsets[i] - base
                for key, block_id in zip(result.keys_to_store, result.block_ids, strict=True):
                    reserved[start + where[key]] = block_id
        blob, width, lens = pack_keys(evicted)
        out.update(reserved=reserved.tobytes(), reserve_ok=ok.tobytes(), evicted=blob,
                   region=self.core.region_id,
                   evicted_lens=lens if lens else bytes([width]) * len(evicted))

    def _store(self, client: bytes, groups: _Groups, gpu: bytes, out: dict[str, Any],
               each: Any) -> None:
        gpu_ids = np.frombuffer(gpu, dtype="<i4")
        jobs = np.full(len(groups), -1, np.int64)
        refused = np.zeros(len(groups), np.uint8)
        accepted = np.zeros(groups.total, np.uint8)
        base = groups.offsets[0]

        def store(i: int, req_id: str | None, keys: list[OffloadKey]) -> None:
            a, b = groups.offsets[i] - base, groups.offsets[i + 1] - base
            job_id, taken, was_refused = self.core.store(client, keys, gpu_ids[a:b].tolist(),
                                                         req_id)
            jobs[i], refused[i] = -1 if job_id is None else job_id, was_refused
            if taken:
                mine = set(taken)
                accepted[a:b] = [k in mine for k in keys]

        each("store", store)
        out.update(store_jobs=jobs.tobytes(), store_refused=refused.tobytes(),
                   store_accepted=accepted.tobytes())

    def _load(self, client: bytes, groups: _Groups, gpu: bytes, out: dict[str, Any],
              each: Any) -> None:
        gpu_ids = np.frombuffer(gpu, dtype="<i4")
        jobs = np.full(len(groups), -1, np.int64)
        sources: list[dict[str, int]] = [{} for _ in range(len(groups))]
        base = groups.offsets[0]

        def load(i: int, req_id: str | None, keys: list[OffloadKey]) -> None:
            a, b = groups.offsets[i] - base, groups.offsets[i + 1] - base
            jobs[i], sources[i] = self.core.load(client, keys, gpu_ids[a:b].tolist(), req_id)

        each("load", load)
        out.update(load_jobs=jobs.tobytes(), load_sources=sources)


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
