"""One engine step's operations, sent together: `Client.batch()` collects the calls
(`lookup`, `pin`, `reserve`, `store`, `step`, ...), `Batch.request` packs them into
one `ops` message with every key in one blob, and the broker's one reply is read
back into one result per call, in call order (`tierkv.client_results`).

Kept apart from `tierkv.client`, which owns the socket: building and reading a
batch is pure, so it is tested without a broker.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tierkv.client_results import Load, Lookup, RemoteError, Reserve, Step, Store
from tierkv.core.keys import MAX_KEY_LEN, OffloadKey, check_keys
from tierkv.wire.keyblob import pack_counts, pack_keys, unpack_ints, unpack_keys
from tierkv.wire.protocol import (
    KEY_SECTIONS,
    LOOKUP_STATUSES,
    KeyGroups,
    OpsRequest,
    OpsResult,
    Reply,
    RequestContext,
    to_record,
)

if TYPE_CHECKING:
    from tierkv.client import Client


class _Section:
    """One section of a batch: its groups of keys (one per call), in call order."""

    __slots__ = ("extra", "groups", "req_ids")

    def __init__(self) -> None:
        self.groups: list[Sequence[OffloadKey]] = []
        self.req_ids: list[str] = []
        self.extra: list[Any] = []  # per call: gpu ids (store, load) or ok (commit)


_SECTIONS = KEY_SECTIONS


class Batch:
    """Operations of one engine step, sent together in one `ops` message."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._sections: dict[str, _Section] = {}
        self._finish: list[str] = []
        self._contexts: list[RequestContext] = []
        self._status = False
        self._pin: bool | None = None  # every lookup of a batch pins, or none does
        self._step = self._poll = False
        self._wait: list[int] = []
        self._wait_s = 0.0
        self._region = ""  # the region the committed rows were written into
        self._slots: list[tuple[str, int]] = []  # per call: (kind, index in its section)

    def _add(self, name: str, keys: Sequence[OffloadKey], req_id: str | None = None,
             extra: Any = None) -> Batch:
        # Keys are checked once for the whole batch, when it is packed (`request`).
        section = self._sections.get(name)
        if section is None:  # not `setdefault`: it would build a section per call
            section = self._sections[name] = _Section()
        section.groups.append(keys if isinstance(keys, (list, tuple)) else list(keys))
        section.req_ids.append(req_id or "")
        section.extra.append(extra)
        self._slots.append((name, len(section.groups) - 1))
        return self

    def lookup(self, keys: Sequence[OffloadKey], req_id: str | None = None,
               status: bool = False, pin: bool = False) -> Batch:
        if self._pin is not None and self._pin != pin:
            raise ValueError("the lookups of one batch either all pin their hits or none does")
        self._pin = pin
        self._status = self._status or status
        return self._add("lookup", keys, req_id, status)

    def store(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int],
              req_id: str | None = None) -> Batch:
        return self._add("store", keys, req_id, _ids(gpu_block_ids, keys))

    def load(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int],
             req_id: str | None = None) -> Batch:
        return self._add("load", keys, req_id, _ids(gpu_block_ids, keys))

    def reserve(self, keys: Sequence[OffloadKey], req_id: str | None = None) -> Batch:
        return self._add("reserve", keys, req_id)

    def commit(self, keys: Sequence[OffloadKey], ok: bool = True, region: str = "") -> Batch:
        self._written_into(region)
        return self._add("commit", keys, None, bool(ok))

    def _written_into(self, region: str) -> None:
        if region and self._region and region != self._region:
            raise ValueError(f"commits of one batch name two regions: {self._region!r} "
                             f"and {region!r}")
        self._region = region or self._region

    def commit_as(self, reserved: Sequence[OffloadKey], keys: Sequence[OffloadKey],
                  region: str = "") -> Batch:
        """End reservations of `reserved` whose rows were written with the blocks of
        `keys` (co-indexed). Its result: per pair, whether the row is now that key's
        block (False: the key was present or being written already; the row is freed)."""
        if len(reserved) != len(keys):
            raise ValueError(f"{len(reserved)} reserved keys but {len(keys)} keys")
        self._written_into(region)
        return self._add("commit_as", [*reserved, *keys])

    def pin(self, keys: Sequence[OffloadKey], req_id: str | None = None) -> Batch:
        return self._add("pin", keys, req_id)

    def release(self, keys: Sequence[OffloadKey]) -> Batch:
        return self._add("release", keys)

    def touch(self, keys: Sequence[OffloadKey]) -> Batch:
        return self._add("touch", keys)

    def waiting(self, requests: Sequence[Sequence[OffloadKey]]) -> Batch:
        """The prefix keys of requests waiting in the engine's queue (advice)."""
        for keys in requests:
            self._add("queue", keys)
        return self

    def finish(self, req_id: str) -> Batch:
        self._finish.append(req_id)
        self._slots.append(("finish", 0))
        return self

    def context(self, context: RequestContext) -> Batch:
        """What the engine knows of a request: tiers it may use, session, hints."""
        self._contexts.append(context)
        return self

    def step(self) -> Batch:
        self._step = True
        self._slots.append(("step", 0))
        return self

    def poll(self) -> Batch:
        self._poll = True
        self._slots.append(("step", 0))
        return self

    def wait_for(self, job_ids: Sequence[int], seconds: float) -> Batch:
        """Have the broker answer only once these jobs finished (or `seconds` passed)."""
        self._wait, self._wait_s = list(job_ids), seconds
        return self

    def request(self, request_id: int) -> OpsRequest:
        """The one `ops` message these calls make."""
        keys: list[OffloadKey] = []
        fields: dict[str, Any] = {}
        for name in _SECTIONS:
            section = self._sections.get(name)
            if section is None:
                continue
            for group in section.groups:
                keys.extend(group)
            req_ids = section.req_ids if any(section.req_ids) else []
            fields[name] = KeyGroups(pack_counts([len(g) for g in section.groups]), req_ids)
            if name == "commit":
                fields["commit_ok"] = bytes(section.extra)
            elif name in ("store", "load"):
                fields[f"{name}_gpu"] = np.concatenate(
                    [np.asarray(e, "<i4") for e in section.extra]).tobytes()
        blob, width, lens = _packed(keys)
        tokens = self._client.registration_tokens
        if tokens and ("store" in fields or "load" in fields):
            fields["kv_tokens"] = [tokens.get(r, "") for r in range(max(tokens) + 1)]
        lookups = self._sections.get("lookup")
        modes = [bool(e) for e in lookups.extra] if lookups is not None else []
        if any(modes) and not all(modes):  # some groups per key, others a leading run
            fields["lookup_modes"] = bytes(modes)
        if self._client.scope:
            fields["scope"] = self._client.scope
        if lookups is not None and self._client.prefill_tps:
            fields["prefill_tps"] = self._client.prefill_tps
            fields["key_tokens"] = self._client.key_tokens
        return OpsRequest(request_id, blob, width, lens, finish=self._finish,
                          contexts=self._contexts, lookup_status=self._status,
                          lookup_pin=bool(self._pin),
                          step=self._step, poll=self._poll, wait=self._wait,
                          wait_s=self._wait_s, region=self._region, **fields)

    def send(self, timeout: float | None = None) -> list[Any]:
        """One result per call, in call order; a refused call's slot holds its
        `RemoteError` (the others still ran)."""
        client = self._client
        request = self.request(client._id())
        return self.read(client._roundtrip(request, timeout or client.timeout))

    def read(self, reply: Reply) -> list[Any]:
        """The results of this batch's calls from the broker's reply (see `send`);
        raises its `RemoteError` if the whole request was refused."""
        result = self._client._unwrap(reply)
        answers = result if isinstance(result, OpsResult) else to_record(OpsResult, result)
        self._client._saw_region(answers.region)
        return _Answers(self, answers).in_call_order()

    def send_one(self, timeout: float | None = None) -> Any:
        """`send` for a batch of one call: its result, or its RemoteError raised."""
        (result,) = self.send(timeout)
        if isinstance(result, RemoteError):
            raise result
        return result

    def __len__(self) -> int:
        return len(self._slots)


def _packed(keys: list[OffloadKey]) -> tuple[bytes, int, bytes]:
    """The batch's keys as a blob, checked as a whole (C-level joins and counts):
    bytes of 1..64, else the error `check_keys` gives, naming the culprit."""
    try:
        blob, width, lens = pack_keys(keys)
    except (TypeError, ValueError):
        check_keys(keys)  # names the key that is not bytes or too long
        raise
    if (width and not 0 < width <= MAX_KEY_LEN) or (lens and not 0 < min(lens) <= max(lens)
                                                     <= MAX_KEY_LEN):
        check_keys(keys)
    return blob, width, lens


def _ids(gpu_block_ids: Sequence[int], keys: Sequence[OffloadKey]) -> list[int]:
    ids = list(gpu_block_ids)
    if len(ids) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(ids)} gpu_block_ids")
    return ids


class _Answers:
    """An `OpsResult` read back into one result per call."""

    def __init__(self, batch: Batch, result: OpsResult) -> None:
        self.batch = batch
        self.r = result
        self.errors = {(e.section, e.index): RemoteError(e.code, e.message)
                       for e in result.errors}
        self._cache: dict[str, Any] = {}

    def in_call_order(self) -> list[Any]:
        lookups = self._lookups() if "lookup" in self.batch._sections else []
        out: list[Any] = []
        errors = self.errors
        for name, index in self.batch._slots:
            error = errors.get((name, index)) if errors else None
            if error is not None:
                out.append(error)
            elif name == "lookup":
                out.append(lookups[index])
            else:
                out.append(self.answer(name, index))
        return out

    def _lookups(self) -> list[Lookup]:
        """Every lookup's answer at once (an engine step has hundreds)."""
        section = self.batch._sections["lookup"]
        hits = self._array("hits", "i")
        state = self._array("state", "B")
        if not any(section.extra) and not self.batch._pin and not self.r.slower:
            arrivals = self.r.arrivals
            return [Lookup(h, s != 0, s == 2, arrivals=arrivals)
                    for h, s in zip(hits, state, strict=True)]
        return [self._lookup(i, section) for i in range(len(hits))]

    def _array(self, field_name: str, typecode: str) -> list[int]:
        """A per-group or per-key field as ints: "B" uint8, "i" int32, "q" int64."""
        values = self._cache.get(field_name)
        if values is None:
            data = getattr(self.r, field_name)
            values = self._cache[field_name] = unpack_ints(data, typecode)
        return values

    def _span(self, name: str, index: int) -> tuple[int, int]:
        """Where group `index` of a section sits in that section's per-key arrays."""
        offsets = self._cache.get(f"offsets:{name}")
        if offsets is None:
            sizes = [len(g) for g in self.batch._sections[name].groups]
            offsets = self._cache[f"offsets:{name}"] = [0, *itertools.accumulate(sizes)]
        return offsets[index], offsets[index + 1]

    def answer(self, name: str, index: int) -> Any:
        section = self.batch._sections.get(name)
        if name == "lookup":
            return self._lookup(index, section)
        if name == "pin":
            a, b = self._span(name, index)
            return self._array("pinned", "i")[a:b]
        if name == "reserve":
            a, b = self._span(name, index)
            evicted = self._cache.setdefault("evicted", unpack_keys(
                self.r.evicted, 0, self.r.evicted_lens, "evicted"))
            ok = bool(self._array("reserve_ok", "B")[index])
            return Reserve(self._array("reserved", "i")[a:b], ok, evicted if ok else [],
                           self.r.region)
        if name == "commit_as":
            a, b = self._span(name, index)
            return [bool(x) for x in self._array("stored_as", "B")[a // 2:b // 2]]
        if name == "store":
            a, b = self._span(name, index)
            job = self._array("store_jobs", "q")[index]
            accepted = self._array("store_accepted", "B")[a:b]
            assert section is not None
            keys = [k for k, took in zip(section.groups[index], accepted, strict=True) if took]
            return Store(None if job < 0 else job, keys,
                         bool(self._array("store_refused", "B")[index]))
        if name == "load":
            return Load(self._array("load_jobs", "q")[index], self.r.load_sources[index])
        if name == "step":
            return Step(self.r.finished, self.r.events, self.r.step, self.r.events_dropped)
        return None  # commit, release, touch, finish, queue

    def _lookup(self, index: int, section: _Section | None) -> Lookup:
        hits = self._array("hits", "i")[index]
        state = self._array("state", "B")[index]
        statuses = sources = rows = None
        if section is not None and section.extra[index]:
            a, b = self._span("lookup", index)
            statuses = [LOOKUP_STATUSES[s] for s in self._array("status", "B")[a:b]]
            tiers = self.r.tiers
            sources = [tiers[s - 1] if s else None for s in self._array("sources", "B")[a:b]]
        if self.batch._pin:
            a, b = self._span("lookup", index)
            rows = self._array("rows", "i")[a:b]
        slower = self._slower(index) if self.r.slower else None
        if rows is None:
            return Lookup(hits, state != 0, state == 2, statuses, sources, slower=slower,
                          arrivals=self.r.arrivals)
        return Lookup(hits, state != 0, state == 2, statuses, sources, rows, self.r.region,
                      self.r.pin_s, slower, self.r.arrivals)

    def _slower(self, index: int) -> dict[str, int] | None:
        tiers = self.r.tiers
        counts = self._array("slower", "i")[index * len(tiers):(index + 1) * len(tiers)]
        return {t: n for t, n in zip(tiers, counts, strict=True) if n} or None
