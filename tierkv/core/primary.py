"""The CPU-tier block manager: which key lives in which row, and in what state.

Per block: free -> writing -> ready, plus a reader count. A block in `writing`, or
with readers, is never evicted and never overwritten; only `ready` blocks are hits.
Readers are loads to the GPU (`prepare_load`), cascades to secondary tiers and
promotion leases (`acquire`). The manager runs on one thread (the broker's loop)
and does no I/O: it decides, the workers move bytes.

Recency rule: a *completed* load counts as a use (the policy is touched), as does
an explicit `touch`; a lookup alone does not, so a scheduler that looks up and
then does not load leaves the order as it was.
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

from tierkv.core.keys import MAX_KEY_LEN, OffloadEvent, OffloadKey
from tierkv.core.policies import CachePolicy, make_policy
from tierkv.core.policies.hints import RequestHints
from tierkv.core.reuse import ReuseFilter

# The prefix of a withdrawn block's placeholder key (see `PrimaryTier.withdraw`).
WITHDRAWN = b"\x00withdrawn".ljust(MAX_KEY_LEN + 1, b"\x00")


class BlockStateError(RuntimeError):
    """An operation that the block states forbid (unknown key, not ready, ...)."""


class State(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True)
class Block:
    block_id: int
    state: State
    readers: int = 0


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    block_ids: list[int]  # co-indexed with keys_to_store
    evicted_keys: list[OffloadKey] = field(default_factory=list)


class _Pinned:
    """`protected` for the policy: keys of the current call, and blocks with readers."""

    __slots__ = ("blocks", "call_keys")

    def __init__(self, blocks: dict[OffloadKey, Block], call_keys: set[OffloadKey]) -> None:
        self.blocks = blocks
        self.call_keys = call_keys

    def __contains__(self, key: object) -> bool:
        if key in self.call_keys:
            return True
        block = self.blocks.get(key)  # type: ignore[call-overload]
        return block is not None and (block.readers > 0 or block.state is State.WRITING)


class PrimaryTier:
    """Block manager of the shared-memory CPU tier."""

    def __init__(
        self,
        num_blocks: int,
        policy: str | CachePolicy = "lru",
        name: str = "cpu",
        reuse_filter: ReuseFilter | None = None,
        enable_events: bool = True,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.name = name
        self.policy: CachePolicy = (
            make_policy(policy, num_blocks) if isinstance(policy, str) else policy
        )
        self.reuse_filter = reuse_filter
        self.enable_events = enable_events
        self._blocks: dict[OffloadKey, Block] = {}
        # The ready keys again, as a set: a lookup walks a request's leading run in
        # C (`takewhile` over `set.__contains__`), ~20 ns a key instead of ~100.
        self._ready: set[OffloadKey] = set()
        # A heap: the lowest free id first, also after evictions freed ids out of
        # order, so the copy engines get runs of consecutive rows (reversed ids cost
        # 8-12 % per job).
        self._free: list[int] = list(range(num_blocks))
        self._events: list[OffloadEvent] = []
        self._writing = 0
        self._counters = dict.fromkeys(
            ("lookups", "hits", "misses", "evictions", "stores_prepared", "stores_completed",
             "stores_failed", "stores_refused", "loads_prepared", "loads_completed"), 0
        )

    # -- queries ------------------------------------------------------------------

    def lookup(self, keys: list[OffloadKey]) -> int:
        """The number of leading keys whose blocks are ready."""
        if self.reuse_filter is not None:
            self.reuse_filter.record(keys)
        ready = self._ready
        if not keys or keys[0] not in ready:
            hits = 0
        elif ready.issuperset(keys):  # every key (the common hit): one loop in C
            hits = len(keys)
        else:  # the keys it checked before the miss have their hashes cached now
            hits = len(list(takewhile(ready.__contains__, keys)))
        c = self._counters
        c["lookups"] += 1
        c["hits"] += hits
        c["misses"] += len(keys) - hits
        return hits

    def is_ready(self, key: OffloadKey) -> bool:
        return key in self._ready

    def contains(self, key: OffloadKey) -> bool:
        """Ready or being written."""
        return key in self._blocks

    def block_id(self, key: OffloadKey) -> int | None:
        block = self._blocks.get(key)
        return None if block is None else block.block_id

    def readers(self, key: OffloadKey) -> int:
        block = self._blocks.get(key)
        return 0 if block is None else block.readers

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    # -- stores ----------------------------------------------------------------

    def prepare_store(
        self, keys: Iterable[OffloadKey], *, filtered: bool = True,
        protect: Iterable[OffloadKey] = (),
    ) -> PrepareStoreOutput | None:
        """Allocate blocks in `writing` for the keys not present yet.

        Evicts ready, unreferenced blocks through the policy when needed, never one
        of `keys` or of `protect`. Returns None, changing nothing, if room cannot be
        made. `filtered=False` bypasses the reuse filter (promotions from a lower tier).
        """
        blocks = self._blocks
        keys = list(keys)
        new_keys = [k for k in dict.fromkeys(keys) if k not in blocks]
        if filtered and self.reuse_filter is not None:
            new_keys = self.reuse_filter.filter(new_keys)
        if not new_keys:
            return PrepareStoreOutput([], [], [])
        shortfall = len(new_keys) - len(self._free)
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            if shortfall > self.num_blocks:
                self._counters["stores_refused"] += 1
                return None
            call_keys = set(keys)
            call_keys.update(protect)
            victims = self.policy.evict(shortfall, _Pinned(blocks, call_keys))
            if victims is None:
                self._counters["stores_refused"] += 1
                return None
            evicted = [key for key, _ in victims]
            for key in evicted:
                del blocks[key]
            self._ready.difference_update(evicted)
            self._free.extend(block_id for _, block_id in victims)
            heapq.heapify(self._free)  # O(free + victims): fewer than the new keys
            self._counters["evictions"] += len(evicted)
            self._emit("removed", evicted)
        block_ids = self._take_free(len(new_keys))
        writing = State.WRITING
        blocks.update(zip(new_keys, [Block(block_id, writing) for block_id in block_ids],
                          strict=True))
        self._writing += len(new_keys)
        self._counters["stores_prepared"] += len(new_keys)
        return PrepareStoreOutput(new_keys, block_ids, evicted)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> list[OffloadKey]:
        """End a store: writing -> ready, or writing -> free on failure.

        Ready keys are left as they are (idempotent). Returns the keys whose state
        changed. Raises BlockStateError, changing nothing, for an unknown key.
        """
        writing = self._writing_blocks(list(dict.fromkeys(keys)), "complete_store")
        changed = [key for key, _ in writing]
        self._writing -= len(changed)
        if success:
            insert = self.policy.insert
            for key, block in writing:
                block.state = State.READY
                insert(key, block.block_id)
            self._ready.update(changed)
            self._counters["stores_completed"] += len(changed)
            self._emit("stored", changed)
        else:
            for key in changed:
                block = self._blocks.pop(key)
                heapq.heappush(self._free, block.block_id)
            self._counters["stores_failed"] += len(changed)
        return changed

    def withdraw(self, key: OffloadKey) -> OffloadKey:
        """Take a block in `writing` away from its key but keep its row: the key is
        absent (a miss, not pending) while a late writer may still write the row.
        Returns the placeholder that holds the row; `complete_store(placeholder,
        False)` frees it. Placeholders are longer than any key a client can name."""
        block = self._blocks.get(key)
        if block is None or block.state is not State.WRITING:
            raise BlockStateError(f"withdraw: key {key.hex()} is not being written")
        placeholder = WITHDRAWN + block.block_id.to_bytes(4, "big")
        del self._blocks[key]
        self._blocks[placeholder] = block
        return placeholder

    def rename(self, key: OffloadKey, new_key: OffloadKey) -> bool:
        """Let the block `key` is being written into hold `new_key` instead (a writer
        that took its row before it knew what it would write). False, changing
        nothing, if `new_key` is present or being written, or the reuse filter does
        not admit it: then the written bytes are not needed."""
        block = self._blocks.get(key)
        if block is None or block.state is not State.WRITING:
            raise BlockStateError(f"rename: key {key.hex()} is not being written")
        if new_key in self._blocks or (self.reuse_filter is not None
                                       and not self.reuse_filter.filter([new_key])):
            return False
        del self._blocks[key]
        self._blocks[new_key] = block
        return True

    # -- readers -----------------------------------------------------------------

    def acquire(self, keys: Iterable[OffloadKey]) -> list[int]:
        """Add a reader to each ready key (protects it). Returns co-indexed block ids."""
        keys = list(keys)
        for key in keys:
            block = self._blocks.get(key)
            if block is None or block.state is not State.READY:
                state = "unknown" if block is None else block.state.value
                raise BlockStateError(f"cannot read key {key.hex()}: it is {state}, not ready")
        ids = []
        for key in keys:
            block = self._blocks[key]
            block.readers += 1
            ids.append(block.block_id)
        return ids

    def release(self, keys: Iterable[OffloadKey]) -> None:
        """Drop one reader of each key. Raises, changing nothing, on an over-release."""
        blocks = self._blocks
        # One look-up per distinct key (a load ends ~1000 at once); all checked first.
        taken = []
        for key, n in Counter(keys).items():
            block = blocks.get(key)
            if block is None:
                raise BlockStateError(f"release: unknown key {key.hex()}")
            taken.append((key, block, n))
        for key, block, n in taken:
            if block.readers < n:
                raise BlockStateError(
                    f"release of key {key.hex()}: {n} released but {block.readers} held"
                )
        for _, block, n in taken:
            block.readers -= n

    def prepare_load(self, keys: Iterable[OffloadKey]) -> list[int]:
        """Protect ready keys for a load to the GPU. Returns co-indexed block ids."""
        ids = self.acquire(keys)
        self._counters["loads_prepared"] += len(ids)
        return ids

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        """End a load: release the readers; a completed load counts as a use."""
        keys = list(keys)
        self.release(keys)
        self.policy.touch(keys)
        self._counters["loads_completed"] += len(keys)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.policy.touch(keys)

    # -- engine hints (advice for the policy; see tierkv.core.policies.base) -------------

    def note_request(self, req_id: Hashable, keys: Sequence[OffloadKey],
                     hints: RequestHints | None = None, now: float = 0.0) -> None:
        """A request was looked up with this full key chain and these hints."""
        self.policy.note_request(req_id, keys, hints, now)

    def note_finish(self, req_id: Hashable, now: float = 0.0) -> None:
        """The request finished."""
        self.policy.note_finish(req_id, now)

    def note_queue(self, chains: Sequence[Sequence[OffloadKey]],
                   now: float = 0.0) -> list[OffloadKey]:
        """The key chains of the requests waiting in the engine's queue (first to be
        scheduled first), once per step. Returns the prefetch candidates: per chain,
        in queue order, the keys after its leading run of ready blocks that this
        tier does not hold (a manager promotes them from slower tiers)."""
        self.policy.note_queue(chains, now)
        blocks = self._blocks
        wanted: dict[OffloadKey, None] = {}
        for chain in chains:
            run = 0
            for key in chain:
                block = blocks.get(key)
                if block is None or block.state is not State.READY:
                    break
                run += 1
            for key in chain[run:]:
                if key not in blocks:
                    wanted[key] = None
        return list(wanted)

    # -- maintenance -------------------------------------------------------------

    def clear(self) -> list[OffloadKey]:
        """Free every ready block without readers (a reset). Returns the keys removed."""
        removed = [k for k, b in self._blocks.items() if b.state is State.READY and not b.readers]
        for key in removed:
            block = self._blocks.pop(key)
            self.policy.remove(key)
            self._ready.discard(key)
            heapq.heappush(self._free, block.block_id)
        self._emit("removed", removed)
        return removed

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, Any]:
        writing = self._writing
        ready = len(self._blocks) - writing
        return {
            "tier": self.name,
            "num_blocks": self.num_blocks,
            "blocks_ready": ready,
            "blocks_writing": writing,
            "blocks_free": len(self._free),
            "usage": (ready + writing) / self.num_blocks,
            **self._counters,
            **(self.reuse_filter.stats() if self.reuse_filter else {}),
            **{f"policy_{k}": v for k, v in self.policy.stats().items()},
        }

    def check_invariants(self) -> None:
        """Assert the structural invariants (tests and debug builds call this)."""
        ids = [b.block_id for b in self._blocks.values()]
        assert len(ids) == len(set(ids)), "a block id belongs to two keys"
        assert not set(ids) & set(self._free), "a used block is on the free list"
        assert len(ids) + len(self._free) == self.num_blocks, "blocks leaked"
        ready = {k for k, b in self._blocks.items() if b.state is State.READY}
        assert ready == self._ready, "the ready set and the ready blocks differ"
        assert len(self.policy) == len(ready), "policy and ready blocks differ"
        assert all(k in self.policy for k in ready), "a ready block is missing from the policy"
        writing = sum(1 for b in self._blocks.values() if b.state is State.WRITING)
        assert writing == self._writing, "writing count drifted"
        assert all(b.readers >= 0 for b in self._blocks.values()), "negative reader count"

    # -- helpers -------------------------------------------------------------------

    def _take_free(self, n: int) -> list[int]:
        """The `n` lowest free ids, ascending (n <= free blocks). A store that
        fills the tier takes them all: one sort instead of n pops."""
        free = self._free
        if n == len(free):
            ids = sorted(free)
            free.clear()
            return ids
        return [heapq.heappop(free) for _ in range(n)]

    def _writing_blocks(self, keys: list[OffloadKey], op: str
                        ) -> list[tuple[OffloadKey, Block]]:
        """The keys' blocks still in `writing`, in order; one look-up per key (a
        job ends ~1000 at once). Raises BlockStateError for an unknown key, before
        anything changes."""
        blocks, state = self._blocks, State.WRITING
        out = []
        for key in keys:
            block = blocks.get(key)
            if block is None:
                raise BlockStateError(f"{op}: unknown key {key.hex()}")
            if block.state is state:
                out.append((key, block))
        return out

    def _emit(self, kind: str, keys: list[OffloadKey]) -> None:
        if self.enable_events and keys:
            self._events.append(OffloadEvent(kind, tuple(keys), self.name))  # type: ignore[arg-type]
