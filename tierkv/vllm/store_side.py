"""The manager's store side: `prepare_store` takes spare rows or reserves rows in a
round trip within the step's budget, and returns only the chunks this job writes;
`complete_store` commits or aborts the job's reservations. `manager.py`'s docstring
says what a store is offered and why."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, PrepareStoreOutput, ReqContext

from tierkv.client import RemoteError
from tierkv.vllm.jobs import TierkvLoadStoreSpec
from tierkv.vllm.manager_state import ManagerState
from tierkv.vllm.rounds import Metrics
from tierkv.vllm.spares import TRUST_S, Spare


class StoreSide(ManagerState):
    """Stores (see the module docstring)."""

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        self.rounds.catch_up()
        req_id = req_context.req_id
        if self.rounds.down:
            self._waiting.refused(req_id, len(keys), "the broker was unavailable")
            return None
        holdings, keymap, present = self.holdings, self.keymap, self.present
        offered = [bytes(k) for k in keys]
        todo: list[bytes] = []
        there: list[bytes] = []
        for chunk in offered:
            key = keymap.key(chunk)
            if present.has(key):
                there.append(chunk)
            elif not holdings.busy(chunk, [key]):
                todo.append(chunk)
        if there:
            holdings.touch(keymap.keys(self._tail_first(there, req_context)))
        if not todo:
            self._waiting.stored(req_id)
            return self._nothing_to_store()
        spares = self._spares_for(req_id, len(todo))
        if len(spares) == len(todo):
            self._waiting.stored(req_id)
            return self._reserved(todo, req_id, [s.row for s in spares], self.spares.region,
                                  req_context, [s.key for s in spares])
        region = self.spares.region  # the spares' (a reply may void them)
        rest = todo[len(spares):]
        reply = self._reserve_rest(req_id, rest)
        if spares and self.spares.region != region:
            # The broker restarted: the spares taken are void (not given back), and the
            # rows just reserved are let go of (offered again, the job gets fresh ones).
            if not isinstance(reply, str):
                self.holdings.commit([k for k, row in zip(keymap.keys(rest), reply.block_ids,
                                                          strict=True) if row >= 0], False)
            reply = "the broker restarted"
        elif isinstance(reply, str):
            self.spares.give_back(spares)
        if isinstance(reply, str):
            self._waiting.refused(req_id, len(todo), reply)
            return None  # offered again next step
        self._waiting.stored(req_id)
        return self._reserved(todo, req_id, [s.row for s in spares] + list(reply.block_ids),
                              reply.region, req_context, [s.key for s in spares])

    def _spares_for(self, req_id: str, n: int) -> list[Spare]:
        """Up to `n` spare rows for a store; none while the broker has been silent
        `TRUST_S` (it may have restarted: the store's own reservation, answered, says
        so). A store that waits for rows waits first for the end-of-step round trip
        that reserves spares for it (`SpareRows.want`), within the step's budget."""
        flush = self.rounds.flush
        if req_id in self._waiting and flush is not None and self.rounds.can_wait():
            if self.rounds.wait(flush, abandon=False):
                self.rounds.catch_up()
        trusted = time.monotonic() - self.link.heard_at <= TRUST_S
        return self.spares.take(n, trusted)

    def _reserve_rest(self, req_id: str, chunks: list[bytes]) -> Any:
        """Reserve rows for `chunks` in a round trip of its own, within the step's
        budget: the broker's reply, or why there are none (a string)."""
        if not self.rounds.can_wait():
            self.rounds.stats.increase_counter(Metrics.OVER_BUDGET)
            return "the step's budget_ms was spent"
        batch, carried = self.rounds.open(self.generation)
        carried.reserve = self.keymap.keys(chunks)
        batch.reserve(carried.reserve, req_id)
        call = self.rounds.send((batch, carried))
        if not self.rounds.wait(call):
            return "the broker did not answer within the step's budget_ms"
        self.rounds.apply(call)
        reply = call.results[-1] if call.results is not None else None
        if reply is None or isinstance(reply, RemoteError) or not reply.ok:
            if isinstance(reply, RemoteError):
                self._warn.warning("reserve", "tierkv refused a reservation: %s", reply)
            self.rounds.stats.increase_counter(Metrics.REFUSED_BLOCKS, len(carried.reserve))
            if isinstance(reply, RemoteError):
                return f"refused: {reply}"
            return "the broker did not answer" if reply is None else "no room in the CPU tier"
        return reply

    def _reserved(self, todo: list[bytes], req_id: str, rows: Sequence[int], region: str,
                  ctx: ReqContext, spares: Sequence[bytes] = ()) -> PrepareStoreOutput:
        """The chunks a reservation gave rows to are this job's; the others are
        present (a use of them) or not admitted. With `spares`, the first chunks' rows
        are those spare rows' (`spares.py`), committed as the chunks' keys."""
        stored: list[bytes] = []
        stored_rows: list[int] = []
        present: list[bytes] = []
        for i, (chunk, row) in enumerate(zip(todo, rows, strict=True)):
            if row >= 0:
                key = self.keymap.key(chunk)
                if i < len(spares):
                    self.holdings.reserved(chunk, req_id, [spares[i]], written_as=key)
                else:
                    self.holdings.reserved(chunk, req_id, [key])
                stored.append(chunk)
                stored_rows.append(row)
            else:
                present.append(chunk)
        if present:
            self.holdings.touch(self.keymap.keys(self._tail_first(present, ctx)))
        self.rounds.stats.increase_counter(Metrics.STORED_BLOCKS, len(stored))
        if not stored:
            return self._nothing_to_store()
        spec = TierkvLoadStoreSpec(self._chunks_per_group(stored), stored_rows, region,
                                   req_id, stored)
        return PrepareStoreOutput(keys_to_store=[OffloadKey(k) for k in stored],
                                  store_spec=spec, evicted_keys=[])

    def _nothing_to_store(self) -> PrepareStoreOutput:
        return PrepareStoreOutput(keys_to_store=[], evicted_keys=[],
                                  store_spec=TierkvLoadStoreSpec(self._chunks_per_group(())))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        # Tail first: a commit inserts into the node's policy, the last most recent.
        for chunk in self._tail_first(keys, req_context):
            chunk = bytes(chunk)
            key = self.holdings.end_store(chunk, req_context.req_id, success)
            if success and key is not None:
                self.present.add(key)
                self._stored_now.add(chunk)

    def _not_stored(self, keys: list[bytes]) -> None:
        """Keys a store wrote whose commit the broker refused: not present, so a later
        offer of them stores them again."""
        for key in keys:
            self.present.forget(key)

    def storing(self, spec: TierkvLoadStoreSpec) -> bool:
        """Whether the store job of `spec` still holds a reservation."""
        return any(self.holdings.writing.get(c) is not None
                   and self.holdings.writing[c].req_id == spec.req_id for c in spec.chunks)

    def store_failed(self, spec: TierkvLoadStoreSpec) -> None:
        """A worker could not write the job of `spec`: its rows are aborted (called by
        `TierkvConnector` before vLLM reports the job complete)."""
        for chunk in spec.chunks:
            self.holdings.end_store(chunk, spec.req_id, False)
