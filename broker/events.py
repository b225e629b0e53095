"""Who hears of which block: the node's stored/removed events, routed to the clients
whose blocks they are, and published whole for routers that watch the node.

An engine's scheduler wants the events of its own blocks (vLLM hands them to its KV
event publisher); with several engines on one broker, handing every event to
whichever client steps first (as before) told each engine a random half of the
story. A key belongs to the client that stored it into the CPU tier; its later
events (cascaded to a tier, evicted, promoted back) go to that client. Keys whose
owner is not known (blocks a restarted broker found in its tiers, or owners
forgotten once `max_owned` keys are tracked) go to the publisher only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from tierkv.core.keys import OffloadEvent, OffloadKey

MAX_EVENTS_PER_CLIENT = 100_000  # a client that never collects loses the oldest
MAX_CLIENTS = 1024  # clients with queued events; the longest silent loses its queue


class EventRouter:
    def __init__(self, publish: Callable[[list[OffloadEvent]], None] | None = None,
                 max_owned: int = 1 << 20) -> None:
        self.publish = publish
        self.max_owned = max_owned
        self._owner: OrderedDict[OffloadKey, bytes] = OrderedDict()
        self._queues: OrderedDict[bytes, deque[OffloadEvent]] = OrderedDict()
        self.dropped = 0  # events a client never collected

    def own(self, client: bytes, keys: Iterable[OffloadKey]) -> None:
        """`client` stored these keys: their events are its to hear."""
        owner = self._owner
        for key in keys:
            owner[key] = client
            owner.move_to_end(key)
        while len(owner) > self.max_owned:
            owner.popitem(last=False)

    def route(self, events: list[OffloadEvent]) -> None:
        """Hand each event's keys to their owners (one event per owner and event)."""
        if not events:
            return
        if self.publish is not None:
            self.publish(events)
        owner = self._owner
        for event in events:
            split: dict[bytes, list[OffloadKey]] = {}
            for key in event.keys:
                client = owner.get(key)
                if client is not None:
                    split.setdefault(client, []).append(key)
            for client, keys in split.items():
                self._queue(client).append(OffloadEvent(event.kind, tuple(keys), event.tier))

    def take(self, client: bytes) -> list[OffloadEvent]:
        queue = self._queues.pop(client, None)
        return list(queue) if queue else []

    def _queue(self, client: bytes) -> deque[OffloadEvent]:
        queue = self._queues.get(client)
        if queue is None:
            queue = self._queues[client] = deque()
            while len(self._queues) > MAX_CLIENTS:
                _, lost = self._queues.popitem(last=False)
                self.dropped += len(lost)
        elif len(queue) >= MAX_EVENTS_PER_CLIENT:
            queue.popleft()
            self.dropped += 1
        return queue
