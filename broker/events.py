"""Who hears of which block: the node's stored/removed events, routed to the clients
whose blocks they are, and published whole for routers that watch the node.

An engine's scheduler wants the events of its own blocks (vLLM hands them to its KV
event publisher); with several engines on one broker, handing every event to
whichever client steps first (as before) told each engine a random half of the
story. A key belongs to the client that stored it into the CPU tier; its later
events (cascaded to a tier, evicted, promoted back) go to that client. Keys whose
owner is not known (blocks a restarted broker found in its tiers, blocks of a
client that ended) go to the publisher only.

Everything here is bounded by what the node holds, not by how long a client stays
silent. An engine that copies its own blocks (reserve, commit) and never steps
still has its keys' events queued; counted in events (each holding every key of a
tick) the old bound held millions of keys, the broker grew by hundreds of MiB a
minute and that client's first step built a reply of millions of keys while every
other engine waited. So:

* a client's queue holds at most `MAX_QUEUED_KEYS` keys (and all queues together
  `MAX_QUEUED_KEYS_TOTAL`): past it the oldest are dropped, and the client is told
  how many (`OpsResult.events_dropped`) with the next events it takes;
* one reply carries at most `MAX_REPLY_KEYS` keys of events, the rest wait for the
  client's next step;
* a key's owner is forgotten once no tier holds it (nor writes it): the owner map
  is as large as the tiers' contents, not a constant.

Socket-free, on the broker's one thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierkv.core.keys import OffloadEvent, OffloadKey

if TYPE_CHECKING:
    from tierkv.core.tiering import TieringManager

# A client's queue, in keys: what an engine stepping every few milliseconds never
# reaches (a step stores or evicts at most a few thousand), and ~5 MiB of 32-byte
# keys for one that never steps.
MAX_QUEUED_KEYS = 1 << 16
MAX_QUEUED_KEYS_TOTAL = 1 << 20  # every client's queue together (~70 MiB at most)
# Keys of events in one reply: encoding 16,384 keys takes a few milliseconds, so a
# client's backlog never holds the broker's one thread (and every other engine) long.
MAX_REPLY_KEYS = 1 << 14
MAX_CLIENTS = 1024  # clients with queued events; the longest silent loses its queue
# Owner entries checked per key owned: each `own` looks at twice as many of the
# oldest entries as it adds, so entries of keys the tiers lost without an event
# (a failed store, a tier process gone) are found while the map is at most a few
# times what the tiers hold.
SWEEP_PER_KEY = 2

Holds = Callable[[OffloadKey], bool]


def tiers_hold(manager: TieringManager) -> Holds:
    """Whether some tier of `manager` holds a key (or is writing it): what keeps a
    key's owner worth remembering."""
    primary, tiers = manager.primary, manager.tiers

    def holds(key: OffloadKey) -> bool:
        return primary.contains(key) or any(tier.holds(key) for tier in tiers)

    return holds


@dataclass(eq=False)
class _Client:
    """One client's side of the router: its queue, counted in keys. Owner entries
    point at it; once the client ended (`live` False) they are dropped when met."""

    identity: bytes
    live: bool = True
    queue: deque[OffloadEvent] = field(default_factory=deque)
    queued_keys: int = 0
    dropped: int = 0  # keys dropped since the client last took its events


class EventRouter:
    """Owners of keys, and each client's queue of its keys' events. On the broker's
    one thread; no method blocks, and each costs in proportion to its keys."""

    def __init__(self, publish: Callable[[list[OffloadEvent]], None] | None = None,
                 holds: Holds = lambda key: True, max_owned: int | None = None) -> None:
        self.publish = publish
        self.holds = holds  # the broker's: `tiers_hold(manager)`
        # A ceiling on owner entries besides what the tiers hold (None: none), the
        # oldest forgotten first; the broker needs none.
        self.max_owned = max_owned
        self._clients: dict[bytes, _Client] = {}
        self._owner: OrderedDict[OffloadKey, _Client] = OrderedDict()  # oldest first
        self._queued: OrderedDict[bytes, _Client] = OrderedDict()  # longest silent first
        self._unswept = 0  # keys owned since the last sweep
        self.queued_keys = 0  # over every queue
        self.dropped = 0  # keys of events a client never took (all clients, ever)

    # -- owners ------------------------------------------------------------------------

    def own(self, client: bytes, keys: Iterable[OffloadKey]) -> None:
        """`client` stored these keys: their events are its to hear."""
        record = self._clients.get(client)
        if record is None:
            record = self._clients[client] = _Client(client)
        owner = self._owner
        for key in keys:
            owner[key] = record
            owner.move_to_end(key)
            self._unswept += 1
        if self.max_owned is not None:
            while len(owner) > self.max_owned:
                owner.popitem(last=False)

    def forget(self, client: bytes) -> None:
        """The client ended: its queue goes now, its owner entries when next met."""
        record = self._clients.pop(client, None)
        if record is not None:
            record.live = False
            self._unqueue(record)

    def _sweep(self, n: int) -> None:
        """Look at the `n` oldest owner entries: those of an ended client or of a key
        no tier holds go, the others move to the back."""
        owner, holds = self._owner, self.holds
        for _ in range(min(n, len(owner))):
            key, record = owner.popitem(last=False)
            if record.live and holds(key):
                owner[key] = record

    # -- events ------------------------------------------------------------------------

    def route(self, events: list[OffloadEvent]) -> None:
        """Hand each event's keys to their owners (one event per owner and event);
        a removed key that no tier holds any more loses its owner. `events` are all
        the tiers emitted since the last call: the broker routes at every step."""
        if events:
            self._route(events)
        # After routing: an entry the sweep drops had all its events routed first.
        self._sweep(SWEEP_PER_KEY * self._unswept)
        self._unswept = 0

    def _route(self, events: list[OffloadEvent]) -> None:
        if self.publish is not None:
            self.publish(events)
        owner = self._owner
        for event in events:
            split: dict[_Client, list[OffloadKey]] = {}
            for key in event.keys:
                record = owner.get(key)
                if record is not None:
                    split.setdefault(record, []).append(key)
            for record, keys in split.items():
                if record.live:
                    self._append(record, OffloadEvent(event.kind, tuple(keys), event.tier))
            if event.kind == "removed":
                self._disown(event.keys)

    def _disown(self, keys: Iterable[OffloadKey]) -> None:
        """Removed keys no tier holds any more: nobody will hear of them again."""
        owner, holds = self._owner, self.holds
        for key in keys:
            record = owner.get(key)
            if record is not None and not (record.live and holds(key)):
                del owner[key]

    def take(self, client: bytes, limit: int = MAX_REPLY_KEYS) -> list[OffloadEvent]:
        """The client's oldest events, `limit` keys at most: the rest wait for its
        next take, so that no reply of a client's backlog holds the broker long."""
        record = self._clients.get(client)
        if record is None or not record.queue:
            return []
        out: list[OffloadEvent] = []
        room = limit
        queue = record.queue
        while queue and room > 0:
            event = queue[0]
            if len(event.keys) <= room:
                out.append(queue.popleft())
            else:  # the event's first keys now, the others with the next take
                out.append(OffloadEvent(event.kind, event.keys[:room], event.tier))
                queue[0] = OffloadEvent(event.kind, event.keys[room:], event.tier)
            room -= len(out[-1].keys)
        taken = limit - room
        record.queued_keys -= taken
        self.queued_keys -= taken
        self._queued.pop(client, None)
        if queue:  # still behind: it counts as silent from now
            self._queued[client] = record
        return out

    def take_dropped(self, client: bytes) -> int:
        """Keys of the client's events dropped since it last asked: what it tells
        its engine, whose view of the tiers has that many holes."""
        record = self._clients.get(client)
        if record is None:
            return 0
        dropped, record.dropped = record.dropped, 0
        return dropped

    # -- bounds ------------------------------------------------------------------------

    def _append(self, record: _Client, event: OffloadEvent) -> None:
        if record.identity not in self._queued:
            self._queued[record.identity] = record
            while len(self._queued) > MAX_CLIENTS:
                _, longest_silent = self._queued.popitem(last=False)
                self._drop(longest_silent, longest_silent.queued_keys)
        record.queue.append(event)
        record.queued_keys += len(event.keys)
        self.queued_keys += len(event.keys)
        if record.queued_keys > MAX_QUEUED_KEYS:
            self._drop(record, record.queued_keys - MAX_QUEUED_KEYS)
        while self.queued_keys > MAX_QUEUED_KEYS_TOTAL:
            longest_silent = next(iter(self._queued.values()))
            self._drop(longest_silent, self.queued_keys - MAX_QUEUED_KEYS_TOTAL)

    def _drop(self, record: _Client, n: int) -> None:
        """Drop the client's `n` oldest keys of events (all it has at most)."""
        queue = record.queue
        n = min(n, record.queued_keys)
        left = n
        while left > 0:
            event = queue[0]
            if len(event.keys) <= left:
                queue.popleft()
                left -= len(event.keys)
            else:
                queue[0] = OffloadEvent(event.kind, event.keys[left:], event.tier)
                left = 0
        record.queued_keys -= n
        record.dropped += n
        self.queued_keys -= n
        self.dropped += n
        if not queue:
            self._queued.pop(record.identity, None)

    def _unqueue(self, record: _Client) -> None:
        self.queued_keys -= record.queued_keys
        record.queue.clear()
        record.queued_keys = 0
        self._queued.pop(record.identity, None)

    def stats(self) -> dict[str, int]:
        return {"owned_keys": len(self._owner), "queued_keys": self.queued_keys,
                "clients_queued": len(self._queued), "dropped_keys": self.dropped}
