"""What every side of `TierkvOffloadingManager` shares: its options, its state and
the small helpers more than one side reads it through.

The manager (`manager.py`, whose docstring says what it does and why) is one object
built from sides, one module each: `lookup_side.py`, `load_side.py`,
`store_side.py`, `reset_side.py`, and the requests and steps in `manager.py`. Each
side is a `ManagerState`, so each reads the one state this class builds; the state
stays in one object because vLLM holds one `lock` around every call, and the sides'
calls read each other's records within a step.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from vllm.v1.kv_offload.base import OffloadingEvent, OffloadingManager, ReqContext

from tierkv.client import Client
from tierkv.core.loglimit import RateLimitedLog
from tierkv.vllm.identity import EngineIdentity
from tierkv.vllm.layout import KeyMap
from tierkv.vllm.lookups import KnownPresent, RequestLookups, by_group, head_first
from tierkv.vllm.prefill import PrefillRate
from tierkv.vllm.rounds import Carried, Rounds
from tierkv.vllm.spares import WaitingStores
from tierkv.vllm.tiers import NodeTiers

log = logging.getLogger("tierkv.vllm")


@dataclass(frozen=True, slots=True)
class ManagerOptions:
    """The scheduler-thread budget and the knobs around it (see `manager.py`)."""

    budget_ms: float = 20.0
    retry_s: float = 5.0
    flush_s: float = 0.05  # owed operations wait at most this long for a round trip
    sync_lookups: int = 2
    max_lookup_keys: int = 2048  # chunks of one request in one lookup of its own
    lookup_wait_ms: float = 250.0  # a request waits this long for answers, then misses
    pending_wait_ms: float = 5000.0  # and this long for blocks being written or promoted
    spare_rows: int = 1024  # rows reserved ahead for stores, at most (`spares.py`)
    prefetch_requests: int = 64  # new requests looked up before vLLM asks, at most at once


class ManagerState(OffloadingManager):
    """The manager's state, built once for all its sides; vLLM holds `lock` around
    every call but `shutdown`."""

    def __init__(self, client: Client, identity: EngineIdentity, group_ids: Sequence[int],
                 window_groups: Collection[int] = (), tiers: Sequence[tuple[str, str]] = (),
                 options: ManagerOptions = ManagerOptions(), *,
                 enable_events: bool = False) -> None:
        self.identity = identity
        self.group_ids = list(group_ids)  # vLLM's offloaded groups, in spec order
        self.window_groups = frozenset(window_groups)  # scanned from the end
        self.tiers = NodeTiers(tiers)
        self.options = options
        self.enable_events = enable_events
        self.generation = 0
        self.keymap = KeyMap(identity.namespace(0))
        client.scope = self.keymap.prefix  # replies count what arrives in the namespace
        self.rounds = Rounds(client, options.budget_ms, options.retry_s, self._take_lookups,
                             self._take_step, options.spare_rows, self._not_stored)
        self.spares = self.rounds.spares
        self.present = KnownPresent()
        self._waiting = WaitingStores()  # stores that got no rows in their step
        # What recomputing costs this engine (`tierkv.vllm.prefill`), set by the spec;
        # the connector sends it with every step's lookups.
        self.prefill: PrefillRate | None = None
        self.key_tokens = 0  # tokens one chunk (a node key) covers
        self._stored_now: set[bytes] = set()  # chunks this engine stored since the step's end
        self.link = self.rounds.link
        self.holdings = self.rounds.holdings
        self._lock = threading.Lock()
        self._requests: dict[str, RequestLookups] = {}
        self._loading: dict[str, dict[bytes, list[bytes]]] = {}  # req -> chunk -> pins
        self._fenced: list[list[bytes]] = []  # pins of loads in flight at a reset
        self._fenced_writes: list[list[bytes]] = []  # reservations in flight at a reset
        self._step = 0
        self._heard_at, self._heard_step = 0.0, 0  # the last reply, and the step it came by
        self._sync_left = options.sync_lookups
        self._flush_waited = False  # this step waited for the end-of-step answers
        self._idle = False
        self._events: list[OffloadingEvent] = []
        self._queued: dict[str, ReqContext] = {}  # added, not scanned by vLLM yet, in order
        self._warn = RateLimitedLog(log)

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    # -- what the round trips call back (a side defines each) ------------------------

    @abstractmethod
    def _take_lookups(self, carried: Carried, results: Sequence[Any] | None,
                      told: bool) -> None:
        """A call's lookup answers (`lookup_side.py`)."""

    @abstractmethod
    def _take_step(self, step: Any) -> None:
        """The step's reply of an end-of-step round trip (`manager.py`)."""

    @abstractmethod
    def _not_stored(self, keys: list[bytes]) -> None:
        """Keys whose commit the broker refused (`store_side.py`)."""

    # -- plumbing --------------------------------------------------------------------

    def _state(self, ctx: ReqContext) -> RequestLookups:
        state = self._requests.get(ctx.req_id)
        if state is None:
            state = self._requests[ctx.req_id] = RequestLookups(ctx)
        return state

    def _keymap_of(self, generation: int) -> KeyMap:
        if generation == self.generation:
            return self.keymap
        return KeyMap(self.identity.namespace(generation))

    def _chunks_per_group(self, keys: Iterable[bytes]) -> list[int]:
        counts = dict.fromkeys(self.group_ids, 0)
        for group, chunks in by_group(keys).items():
            counts[group] += len(chunks)
        return list(counts.values())

    @staticmethod
    def _tail_first(keys: Iterable[bytes], ctx: ReqContext) -> list[bytes]:
        """`keys` from the request's last block to its first (a set's order is none)."""
        return head_first(keys, ctx)[::-1]

    def _unpin(self, state: RequestLookups, chunks: Iterable[bytes]) -> None:
        """Let go of the pins the request's hits among `chunks` hold."""
        rows = state.rows
        self.holdings.release(self.keymap.keys(
            chunk for chunk in chunks if rows.pop(chunk, None) is not None))

    def _queue_head(self) -> dict[str, ReqContext]:
        """The first `prefetch_requests` requests of vLLM's queue: kept answered until
        it scans them (`_refresh_queue_head`), their hits held while the broker holds
        their pins (`on_schedule_end`)."""
        return dict(islice(self._queued.items(), self.options.prefetch_requests))

    def _deferred(self, state: RequestLookups) -> bool:
        """vLLM was told RETRY for the request, has not been answered since, and will
        still wait for an answer (`lookup_wait_ms`)."""
        since = state.waiting_since
        return since is not None and time.monotonic() - since <= self.options.lookup_wait_ms / 1e3
