"""The manager's load side: a load job's rows, claimed from the pins its request's
lookups hold, and those pins let go of once vLLM says the load is done (or a use
of the blocks, `touch`, passed on to the broker)."""

from __future__ import annotations

from collections.abc import Collection

from vllm.v1.kv_offload.base import LoadStoreSpec, LookupResult, OffloadKey, ReqContext

from tierkv.vllm.jobs import TierkvLoadStoreSpec
from tierkv.vllm.lookups import Answer, hits_in
from tierkv.vllm.manager_state import ManagerState


class LoadSide(ManagerState):
    """Loads (see the module docstring)."""

    def prepare_load(self, keys: Collection[OffloadKey],
                     req_context: ReqContext) -> LoadStoreSpec:
        req_id = req_context.req_id
        state = self._requests.get(req_id)
        loading = self._loading.setdefault(req_id, {})
        chunks = list(keys)
        if state is None:
            answers: list[Answer | None] = [None] * len(chunks)
            rows = [-1] * len(chunks)
        else:  # what the chunks' lookups said, claimed (list comprehensions, in C)
            answers = [state.answers.pop(c, None) for c in chunks]
            state.covered = False
            rows = [state.rows.pop(c, -1) for c in chunks]
        # The load's region: its first hit's (a hit of another is no row of this job).
        region = next((a.region for a in answers
                       if a is not None and a.status is LookupResult.HIT and a.region), "")
        if (chunks and min(rows) >= 0 and hits_in(answers, region)
                and loading.keys().isdisjoint(chunks)):  # the common case
            loading.update(zip(chunks, ([pin] for pin in self.keymap.keys(chunks)), strict=True))
        else:
            rows = [self._claim_row(req_id, chunk, answer, row, region, loading)
                    for chunk, answer, row in zip(chunks, answers, rows, strict=True)]
        return TierkvLoadStoreSpec(self._chunks_per_group(chunks), rows, region, req_id)

    def _claim_row(self, req_id: str, chunk: bytes, answer: Answer | None, row: int,
                   region: str, loading: dict[bytes, list[bytes]]) -> int:
        """A chunk's row for a load job, its pin now the load's; -1 for one that was
        not a pinned hit in `region`: vLLM loads only what lookup called a hit, and
        should it not, the worker fails the job (a miss, recomputed) rather than read
        another key's row."""
        if answer is None or answer.status is not LookupResult.HIT or (
                answer.region != region) or row < 0:
            self._warn.warning("load", "prepare_load of a key that was not a hit "
                               "(request %s)", req_id)
            if row >= 0:
                self.holdings.release([self.keymap.key(chunk)])
            return -1
        loading[chunk] = [*loading.get(chunk, ()), self.keymap.key(chunk)]
        return row

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.holdings.touch(self.keymap.keys(self._tail_first(keys, req_context)))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        loading = self._loading.get(req_context.req_id)
        if not loading:
            return
        # Tail first: the broker counts a finished read as a use, the last most recent,
        # so a prefix's head stays the last to go (a lookup stops at the first miss).
        self.holdings.release([pin for chunk in self._tail_first(keys, req_context)
                               for pin in loading.pop(chunk, ())])
        if not loading:
            del self._loading[req_context.req_id]
