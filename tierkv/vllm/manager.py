"""vLLM's scheduler-side `OffloadingManager`, as a thin proxy to a tierkv node.

vLLM asks about one key at a time (`lookup(key)`), on the scheduler's critical path,
for hundreds of requests a step. A round trip per key would cost more than the
step, so the proxy talks to the broker at most:

* once per request and step, at its first lookup, for the first `sync_lookups`
  requests of a step: the request's key chain from the key asked on (every group)
  with a status per key, its hits pinned in the same broker pass (a hit the engine
  is told about cannot be evicted before it is read: no lease can lapse in
  between); the step's other lookups of that request are answered from it. Later
  requests of the step are told RETRY (vLLM asks again next step) and looked up
  with the end-of-step round trip, as are keys still being promoted from a lower
  tier: their answers serve the next step. (Each round trip costs ~0.2 ms; at 256
  running requests a step admits ~7 new ones.)
* once at the end of the step (`on_schedule_end`), if there is anything to send:
  those lookups; the CPU rows for the step's stores, reserved then, before the
  worker sees them (the store specs are filled in place: vLLM sends the step's
  metadata to the workers after this call); and everything the step deferred —
  commits of finished stores, releases of finished or unused reads, touches,
  finished requests. Deferred operations also ride on the next lookup's round
  trip, and are flushed by age when nothing else goes.

So `prepare_store` never waits for the broker; its spec's rows are -1 for a block
the node would not take (present already, or no room now): the worker skips those,
and only blocks that were reserved are committed. (vLLM's own manager says None
when there is no room and tries again next step; here such blocks are counted in
`vllm:tierkv_store_refused_blocks` and not stored.)

A broker that does not answer within `timeout_s` costs one timeout: the proxy then
answers MISS and stores nothing for `retry_s` (never a wrong hit, never a hang),
and drops the operations it deferred (sending them twice could release a read
that is not ours).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
    get_offload_group_idx,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.client import Batch, BrokerUnavailable, Client, Lookup, RemoteError
from tierkv.core.loglimit import RateLimitedLog
from tierkv.vllm.layout import KeyMap
from tierkv.wire.protocol import RequestContext

log = logging.getLogger("tierkv.vllm")

_STATUS = {"hit": LookupResult.HIT, "pending": LookupResult.HIT_PENDING,
           "miss": LookupResult.MISS, "retry": LookupResult.RETRY}
_SOURCE = {"disk": CacheHitSource.DISK, "s3": CacheHitSource.EXTERNAL_UNSPECIFIED}


class Metrics:
    """Names of what `get_stats` reports (declared by `TierkvOffloadingSpec`)."""

    LOOKUP_KEYS = "vllm:tierkv_lookup_keys"
    HIT_KEYS = "vllm:tierkv_hit_keys"
    STORED_BLOCKS = "vllm:tierkv_stored_blocks"
    REFUSED_BLOCKS = "vllm:tierkv_store_refused_blocks"
    ROUND_TRIPS = "vllm:tierkv_round_trips"
    ROUND_TRIP_SECONDS = "vllm:tierkv_round_trip_seconds"
    BROKER_FAILURES = "vllm:tierkv_broker_failures"


class TierkvLoadStoreSpec(LoadStoreSpec):
    """Where one job's chunks are in the node's CPU tier: `blocks_per_chunk` rows per
    chunk (-1: no row), chunks in job order, counted per KV-cache group, and the
    region (`SharedRegion.generation`) the rows belong to. A store's rows are filled
    at the end of the step that made it (`rows` is None until then)."""

    def __init__(self, chunks_per_group: Sequence[int], rows: Sequence[int] | None = None,
                 region: str = "") -> None:
        self.chunks_per_group = tuple(chunks_per_group)
        self.rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        self.region = region

    def fill(self, rows: Sequence[int], region: str) -> None:
        self.rows = np.asarray(rows, dtype=np.int64)
        self.region = region

    def __repr__(self) -> str:
        return f"TierkvLoadStoreSpec(rows={self.rows}, region={self.region!r})"


@dataclass(slots=True)
class _Answer:
    status: LookupResult
    rows: list[int]
    source: str | None = None
    region: str = ""  # the CPU region `rows` name


_MISS = _Answer(LookupResult.MISS, [])


@dataclass(slots=True)
class _Deferred:
    """What the step leaves for the next round trip (applied in the broker's order:
    commit, release, then the rest)."""

    commit_ok: list[bytes] = field(default_factory=list)
    commit_failed: list[bytes] = field(default_factory=list)
    release: list[bytes] = field(default_factory=list)
    touch: list[bytes] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    contexts: list[RequestContext] = field(default_factory=list)
    since: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.commit_ok or self.commit_failed or self.release or self.touch
                    or self.finish or self.contexts)

    def add_to(self, batch: Batch) -> None:
        if self.commit_ok:
            batch.commit(self.commit_ok, True)
        if self.commit_failed:
            batch.commit(self.commit_failed, False)
        if self.release:
            batch.release(self.release)
        if self.touch:
            batch.touch(self.touch)
        for context in self.contexts:
            batch.context(context)
        for req_id in self.finish:
            batch.finish(req_id)


class TierkvOffloadingManager(OffloadingManager):
    """See the module docstring. One per vLLM scheduler; not shared between threads
    except through `lock`, which vLLM holds around every call."""

    def __init__(self, client: Client, keymap: KeyMap, group_ids: Sequence[int],
                 tiers: Sequence[tuple[str, str]] = (), *, retry_s: float = 5.0,
                 flush_s: float = 0.05, sync_lookups: int = 2,
                 enable_events: bool = False) -> None:
        self.client = client
        self.keymap = keymap
        self.group_ids = list(group_ids)  # vLLM's offloaded groups, in spec order
        self.tiers = list(tiers)  # (name, kind) of the node's secondary tiers
        self.retry_s = retry_s
        self.flush_s = flush_s
        self.sync_lookups = sync_lookups  # requests a step looks up in their own round trip
        self.enable_events = enable_events
        self._lock = threading.Lock()
        # This step's answers and pins, per request: vkey -> answer; vkey -> pinned keys.
        self._answers: dict[str, dict[bytes, _Answer]] = {}
        self._unclaimed: dict[str, dict[bytes, list[bytes]]] = {}
        self._loading: dict[str, dict[bytes, list[bytes]]] = defaultdict(dict)
        self._sync_left = sync_lookups
        self._prefetch: dict[str, list[bytes]] = {}  # looked up at the end of the step
        self._refresh: dict[str, list[bytes]] = {}  # pending: asked again then too
        self._stores: list[tuple[TierkvLoadStoreSpec, str, list[bytes]]] = []
        self._storing: dict[bytes, list[bytes]] = {}  # vkey -> reserved tierkv keys
        self._deferred = _Deferred()
        self._events: list[OffloadingEvent] = []
        self._stats = OffloadingConnectorStats()
        self._down_until = 0.0
        self._idle = False  # the engine has no request left (see `has_pending_work`)
        self._warn = RateLimitedLog(log)

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    # -- lookups ---------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        answers = self._answers.get(req_context.req_id)
        if answers is None or key not in answers:
            answers = self._look_up_request(req_context, key)
        return answers[key].status

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        answer = self._answers.get(req_context.req_id, {}).get(key)
        if answer is None or answer.source is None:
            return CacheHitSource.HOST
        return _SOURCE.get(self._kind(answer.source), CacheHitSource.EXTERNAL_UNSPECIFIED)

    def _look_up_request(self, ctx: ReqContext, key: bytes) -> dict[bytes, _Answer]:
        """Every key of the request not answered yet this step: in a round trip now
        while the step's budget of them lasts, else RETRY (vLLM asks again next
        step) and looked up with the end-of-step round trip."""
        req_id = ctx.req_id
        answers = self._answers.setdefault(req_id, {})
        chain = _request_keys(ctx)
        # From the key asked on: a prefix lookup starts past the blocks vLLM has, and
        # the chain is in vLLM's order (group after group).
        start = chain.index(key) if key in chain else len(chain)
        chain = [k for k in chain[start:] if k not in answers] or [key]
        if self._sync_left <= 0 and not self._broker_down():
            self._prefetch[req_id] = chain
            retry = _Answer(LookupResult.RETRY, [])
            answers.update(dict.fromkeys(chain, retry))
            return answers
        self._sync_left -= 1
        self._take_lookup(req_id, chain, self._send_lookup(req_id, chain))
        return answers

    def _take_lookup(self, req_id: str, chain: list[bytes], found: Lookup | None) -> None:
        """A lookup's answers, per chunk, and the pins its hits hold."""
        answers = self._answers.setdefault(req_id, {})
        unclaimed = self._unclaimed.setdefault(req_id, {})
        self._stats.increase_counter(Metrics.LOOKUP_KEYS, len(chain))
        if found is None or found.statuses is None:
            answers.update(dict.fromkeys(chain, _MISS))
            return
        per_chunk = self.keymap.blocks_per_chunk
        statuses = found.statuses
        rows = found.rows or [-1] * len(statuses)
        sources = found.sources or [None] * len(statuses)
        region = found.region
        prefix = self.keymap.prefix
        hits = 0
        again = []
        for i, vkey in enumerate(chain):
            if per_chunk == 1:  # the common case, without a list per chunk
                status, row = statuses[i], rows[i]
                if status == "hit" and row >= 0:
                    answers[vkey] = _Answer(LookupResult.HIT, [row], sources[i], region)
                    unclaimed[vkey] = [prefix + vkey]
                    hits += 1
                    continue
                answer = _Answer(_STATUS[status] if status != "hit" else LookupResult.MISS, [])
            else:
                a, b = i * per_chunk, (i + 1) * per_chunk
                answer = _chunk_answer(found, a, b)
                pinned = [k for k, r in zip(self.keymap.blocks(vkey), rows[a:b], strict=True)
                          if r >= 0]
                if pinned:
                    unclaimed[vkey] = pinned
                hits += answer.status is LookupResult.HIT
            answers[vkey] = answer
            if answer.status in (LookupResult.HIT_PENDING, LookupResult.RETRY):
                again.append(vkey)
        if again:  # asked again at the end of the step: next step's answer is ready
            self._refresh.setdefault(req_id, []).extend(again)
        self._stats.increase_counter(Metrics.HIT_KEYS, hits)

    def _send_lookup(self, req_id: str, chain: list[bytes]) -> Lookup | None:
        if not chain or self._broker_down():
            return None
        batch = self.client.batch()
        self._deferred.add_to(batch)
        batch.lookup(self.keymap.all_blocks(chain), req_id, status=True, pin=True)
        results = self._send(batch)
        return None if results is None else self._lookup_result(results[-1])

    def _lookup_result(self, found: Any) -> Lookup | None:
        if isinstance(found, RemoteError):
            self._warn.warning("lookup", "tierkv refused a lookup: %s", found)
            return None
        return found

    # -- loads -----------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey],
                     req_context: ReqContext) -> LoadStoreSpec:
        req_id = req_context.req_id
        answers = self._answers.get(req_id, {})
        unclaimed = self._unclaimed.get(req_id, {})
        loading = self._loading[req_id]
        rows: list[int] = []
        region = ""
        for vkey in keys:
            answer = answers.get(vkey)
            region = region or (answer.region if answer is not None else "")
            if answer is None or answer.status is not LookupResult.HIT or (
                    answer.region != region):
                # vLLM loads only what lookup called a hit; should it not, the worker
                # refuses the job rather than read a row that is not this key's.
                self._warn.warning("load", "prepare_load of a key that was not a hit this "
                                 "step (request %s)", req_id)
                rows.extend([-1] * self.keymap.blocks_per_chunk)
                continue
            rows.extend(answer.rows)
            pinned = unclaimed.pop(vkey, None)
            if pinned:
                loading[vkey] = loading.get(vkey, []) + pinned
        return TierkvLoadStoreSpec(self._chunks_per_group(keys), rows, region)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._defer().touch.extend(self.keymap.all_blocks(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        loading = self._loading.get(req_context.req_id)
        if not loading:
            return
        release = self._defer().release
        for vkey in keys:
            release.extend(loading.pop(vkey, ()))
        if not loading:
            del self._loading[req_context.req_id]

    # -- stores ----------------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        if self._broker_down():
            return None
        offered = list(keys)
        spec = TierkvLoadStoreSpec(self._chunks_per_group(offered))
        self._stores.append((spec, req_context.req_id, list(map(bytes, offered))))
        return PrepareStoreOutput(keys_to_store=offered, store_spec=spec, evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        deferred = self._defer()
        out = deferred.commit_ok if success else deferred.commit_failed
        for vkey in keys:
            out.extend(self._storing.pop(vkey, ()))

    def _reserve_stores(self, batch: Batch) -> None:
        for _spec, req_id, keys in self._stores:
            batch.reserve(self.keymap.all_blocks(keys), req_id)

    def _fill_stores(self, reserves: Sequence[Any]) -> None:
        """Give each of the step's store specs its rows (-1 where nothing is to be
        written), and remember what was reserved, to commit it when stored.
        `reserves`: the broker's answer per store, empty if there was none."""
        stores, self._stores = self._stores, []
        stored = refused = 0
        for i, (spec, _req_id, keys) in enumerate(stores):
            reply = reserves[i] if i < len(reserves) else None
            block_keys = self.keymap.all_blocks(keys)
            if reply is None or isinstance(reply, RemoteError) or not reply.ok:
                spec.fill([-1] * len(block_keys), "")
                refused += len(block_keys)
                continue
            spec.fill(reply.block_ids, reply.region)
            per_chunk = self.keymap.blocks_per_chunk
            for j, vkey in enumerate(keys):
                rows = reply.block_ids[j * per_chunk:(j + 1) * per_chunk]
                taken = [k for k, row in zip(block_keys[j * per_chunk:(j + 1) * per_chunk],
                                             rows, strict=True) if row >= 0]
                if taken:
                    self._storing[vkey] = self._storing.get(vkey, []) + taken
                    stored += len(taken)
        self._stats.increase_counter(Metrics.STORED_BLOCKS, stored)
        self._stats.increase_counter(Metrics.REFUSED_BLOCKS, refused)

    # -- requests and steps ----------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        context = self._context_of(req_context)
        if context is not None:
            self._defer().contexts.append(context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        self._release_unclaimed(req_id)
        self._answers.pop(req_id, None)
        self._prefetch.pop(req_id, None)
        self._refresh.pop(req_id, None)
        self._defer().finish.append(req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        for req_id in list(self._unclaimed):
            self._release_unclaimed(req_id)
        self._answers.clear()
        self._sync_left = self.sync_lookups
        for req_id, keys in self._refresh.items():
            self._prefetch.setdefault(req_id, []).extend(keys)
        self._refresh = {}
        deferred = self._deferred
        if self._stores or self._prefetch or (deferred and (
                self._idle or time.monotonic() - deferred.since >= self.flush_s)):
            self._flush()
        self._idle = False

    def has_pending_work(self) -> bool:
        """vLLM asks this only when it has no request left: what was deferred goes at
        the end of the one more step a True buys."""
        self._idle = bool(self._deferred or self._stores or self._prefetch)
        return self._idle

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats, self._stats = self._stats, OffloadingConnectorStats()
        return None if stats.is_empty() else stats

    def reset_cache(self) -> None:
        """vLLM resets its prefix caches: the node is shared, so nothing is dropped
        there; this engine only lets go of what it holds."""
        for req_id in list(self._unclaimed):
            self._release_unclaimed(req_id)
        self._answers.clear()

    def shutdown(self) -> None:
        with self._lock:
            for req_id in list(self._unclaimed):
                self._release_unclaimed(req_id)
            for loading in self._loading.values():
                self._defer().release.extend(k for keys in loading.values() for k in keys)
            self._loading.clear()
            if self._deferred or self._stores:
                self._flush()
        self.client.close()

    # -- plumbing --------------------------------------------------------------------

    def _flush(self) -> None:
        """The end-of-step round trip: deferred operations, the lookups the step left
        for it (their answers serve the next step), the step's reservations."""
        prefetch, self._prefetch = self._prefetch, {}
        results = None
        if not self._broker_down():
            batch = self.client.batch()
            self._deferred.add_to(batch)
            for req_id, chain in prefetch.items():
                batch.lookup(self.keymap.all_blocks(chain), req_id, status=True, pin=True)
            self._reserve_stores(batch)
            batch.step()
            results = self._send(batch)
        else:
            self._deferred = _Deferred()
        if results is None:
            self._fill_stores(())
            return
        self._take_step(results[-1])
        stores = len(self._stores)
        self._fill_stores(results[-1 - stores:-1])
        found = results[-1 - stores - len(prefetch):-1 - stores]
        for (req_id, chain), lookup in zip(prefetch.items(), found, strict=True):
            self._take_lookup(req_id, chain, self._lookup_result(lookup))

    def _send(self, batch: Batch) -> list[Any] | None:
        """Send a batch (deferred operations included, which leave with it)."""
        self._deferred = _Deferred()
        start = time.perf_counter()
        try:
            results = batch.send()
        except (BrokerUnavailable, RemoteError) as e:
            self._stats.increase_counter(Metrics.BROKER_FAILURES)
            self._down_until = time.monotonic() + self.retry_s
            self._warn.warning("broker", "tierkv broker unavailable (%s): no hits and no "
                               "stores for %.0fs", e, self.retry_s)
            return None
        self._stats.increase_counter(Metrics.ROUND_TRIPS)
        self._stats.observe_histogram(Metrics.ROUND_TRIP_SECONDS, time.perf_counter() - start)
        for result in results:
            if isinstance(result, RemoteError):
                self._warn.warning("op", "tierkv refused an operation: %s", result)
        return results

    def _take_step(self, step: Any) -> None:
        if not self.enable_events or isinstance(step, RemoteError):
            return
        for event in step.events:
            keys = [k for k in map(self.keymap.chunk_of, event.keys) if k is not None]
            if not keys:
                continue
            tier = event.tier
            medium = Medium.CPU if tier == "cpu" else Medium.STORAGE
            locality = Locality.REMOTE if self._kind(tier) == "s3" else Locality.LOCAL
            self._events.append(OffloadingEvent(
                keys=[OffloadKey(k) for k in keys], medium=medium,
                removed=event.kind == "removed", locality=locality,
                ownership=None if tier == "cpu" else tier))

    def _release_unclaimed(self, req_id: str) -> None:
        unclaimed = self._unclaimed.pop(req_id, None)
        if unclaimed:
            release = self._defer().release
            for keys in unclaimed.values():
                release.extend(keys)

    def _defer(self) -> _Deferred:
        deferred = self._deferred
        if not deferred:
            deferred.since = time.monotonic()
        return deferred

    def _broker_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _chunks_per_group(self, keys: Iterable[bytes]) -> list[int]:
        counts = dict.fromkeys(self.group_ids, 0)
        for key in keys:
            counts[get_offload_group_idx(OffloadKey(key))] += 1
        return list(counts.values())

    def _kind(self, tier: str) -> str:
        return next((kind for name, kind in self.tiers if name == tier), tier)

    def _context_of(self, ctx: ReqContext) -> RequestContext | None:
        """What tierkv should know of a request: the tiers it may be served from
        (vLLM's load-tier filter) and the orchestrator's hints."""
        tiers = None
        if ctx.load_tier_filter is not TierFilter.ALL:
            tiers = [name for name, kind in self.tiers if ctx.load_tier_filter.allows(
                Medium.STORAGE, Locality.REMOTE if kind == "s3" else Locality.LOCAL)]
        hints = _builtins(ctx.kv_hints) if ctx.kv_hints is not None else None
        if tiers is None and hints is None:
            return None
        return RequestContext(ctx.req_id, tiers=tiers, hints=hints)


def _request_keys(ctx: ReqContext) -> list[bytes]:
    """Every key vLLM has made for the request so far, in the order it made them
    (vLLM records each with its position before it looks any up)."""
    positions: dict[bytes, int] = getattr(ctx, "_offload_key_positions", {})
    return list(positions)


def _chunk_answer(found: Lookup | None, a: int, b: int) -> _Answer:
    """A chunk's status from its blocks': a hit if all are, a miss if any is, then
    retry, then pending."""
    if found is None or found.statuses is None:
        return _Answer(LookupResult.MISS, [], None)
    statuses = found.statuses[a:b]
    if all(s == "hit" for s in statuses):
        rows = found.rows[a:b] if found.rows is not None else []
        if any(r < 0 for r in rows):
            return _Answer(LookupResult.MISS, [], None)
        sources = found.sources[a:b] if found.sources is not None else []
        return _Answer(LookupResult.HIT, list(rows), next((s for s in sources if s), None),
                       found.region)
    for word in ("miss", "retry"):
        if word in statuses:
            return _Answer(_STATUS[word], [], None)
    return _Answer(LookupResult.HIT_PENDING, [], None)


def _builtins(hints: Any) -> dict[str, Any] | None:
    try:
        import msgspec

        value = msgspec.to_builtins(hints)
    except (ImportError, TypeError):
        return None
    return value if isinstance(value, dict) else None
