"""Who owns what in the broker: every block a client reserved or pinned belongs to
that client's connection, and every one of them has a deadline.

Before owners, the broker kept reservations and pins by block key alone, so any
client could commit another's reservation before it was written (a reader got the
row's old bytes under that key), release another's pin or a cascade's reader (the
next tick raised and the broker exited), and a client that died with blocks
reserved left them `writing` for ever: every engine sharing the node saw that prefix
as pending until the broker restarted. Here:

* An **owner** is one ZeroMQ connection on the client link, made by its first
  message and ended by `bye`, by silence past `broker.owner_timeout_s`, or by a
  broker restart. When it ends, its reservations are aborted (rows freed), its
  pins released and its requests finished (leases, queued promotions).
* A `commit` names only keys this owner reserved, a `release` only keys it pinned:
  anything else is refused `not_owner` and changes nothing.
* A **reservation** not committed within `broker.reservation_s` is withdrawn: its
  key is a miss for everyone at once, but its row stays held until the owner
  commits or aborts it, or ends, so a late write never lands in a reused row. A
  **pin** not released within `broker.pin_s` is released. Reserving or pinning the
  key again renews it; a commit or release after the deadline is refused `expired`.
* A **quota**: one owner holds at most `broker.owner_share` of the CPU tier in
  reservations and pins.
* Request ids are scoped by owner (`Owner.scope`): two engines' "r1" are two
  requests, with leases, contexts and hints of their own.

Socket-free, on the broker's one thread.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from broker.arrivals import Arrivals
from tierkv.core.errors import ErrorCode
from tierkv.core.keys import OffloadKey
from tierkv.core.tiering import TieringManager

log = logging.getLogger("broker.owners")

SCOPE = "\x1f"  # between an owner's number and its request id: never in a printable id
SCAN_S = 0.25  # deadlines are checked this often (or a tenth of the shortest one)


class OwnerRefused(Exception):
    """An operation on state the owner does not hold (or no longer holds)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class _Pin:
    count: int
    deadline: float


@dataclass(eq=False)
class Owner:
    identity: bytes
    number: int
    last_seen: float
    reservations: dict[OffloadKey, float] = field(default_factory=dict)  # key -> deadline
    withdrawn: dict[OffloadKey, OffloadKey] = field(default_factory=dict)  # key -> placeholder
    pins: dict[OffloadKey, _Pin] = field(default_factory=dict)
    expired_pins: set[OffloadKey] = field(default_factory=set)  # told at the next release
    next_due: float = float("inf")  # the earliest deadline of its reservations and pins
    prefix: str = ""  # of every request id it scopes
    named_requests: bool = False  # whether it ever did: if not, its end scans nothing
    key_scope: bytes | None = None  # the scope of keys it names (`broker.arrivals`)
    own_arrivals: int = 0  # keys under `key_scope` its stores brought to the CPU tier

    def __post_init__(self) -> None:
        self.prefix = f"{self.number}{SCOPE}"

    def scope(self, req_id: str) -> str:
        """This owner's name for a request id."""
        self.named_requests = True
        return self.prefix + req_id

    def held(self) -> int:
        """CPU blocks held: reserved (withdrawn ones too) and pinned."""
        return len(self.reservations) + len(self.withdrawn) + len(self.pins)


class OwnerTable:
    def __init__(self, manager: TieringManager, *, owner_timeout_s: float,
                 reservation_s: float, pin_s: float, quota_blocks: int,
                 on_end: Callable[[Owner], None] = lambda owner: None) -> None:
        self.manager = manager
        self.arrivals = Arrivals(manager)  # what each owner's replies count
        self.owner_timeout_s = owner_timeout_s
        self.reservation_s = reservation_s
        self.pin_s = pin_s
        self.quota_blocks = max(1, quota_blocks)
        self._on_end = on_end  # what else the broker forgets of an owner (requests, results)
        self._owners: dict[bytes, Owner] = {}
        self._numbers = itertools.count(1)
        self._next_scan = 0.0
        self.counters: dict[str, int] = dict.fromkeys(
            ("owners_ended", "owners_timed_out", "reservations_withdrawn",
             "reservations_aborted", "pins_expired", "pins_released_at_end", "not_owner",
             "quota_refused"), 0)

    # -- who --------------------------------------------------------------------------

    def seen(self, identity: bytes, now: float) -> Owner:
        """The owner of `identity`, made on its first message; heard from now."""
        owner = self._owners.get(identity)
        if owner is None:
            owner = self._owners[identity] = Owner(identity, next(self._numbers), now)
        owner.last_seen = now
        return owner

    def get(self, identity: bytes) -> Owner | None:
        return self._owners.get(identity)

    def __len__(self) -> int:
        return len(self._owners)

    # -- reservations --------------------------------------------------------------------

    def check_room(self, owner: Owner, more: int) -> None:
        """May the owner hold `more` blocks? Raises OwnerRefused(QUOTA)."""
        if more > 0 and owner.held() + more > self.quota_blocks:
            self.counters["quota_refused"] += 1
            raise OwnerRefused(ErrorCode.QUOTA, f"this client holds {owner.held()} CPU blocks "
                               f"reserved or pinned; {more} more would pass its share "
                               f"({self.quota_blocks} blocks, broker.owner_share)")

    def reserved(self, owner: Owner, keys: Iterable[OffloadKey], now: float) -> None:
        deadline = now + self.reservation_s
        for key in keys:
            owner.reservations[key] = deadline
        owner.next_due = min(owner.next_due, deadline)

    def renew(self, owner: Owner, keys: Iterable[OffloadKey], now: float) -> list[OffloadKey]:
        """Keys the owner reserves already get a new deadline; returns those."""
        deadline = now + self.reservation_s
        mine = [k for k in keys if k in owner.reservations]
        for key in mine:
            owner.reservations[key] = deadline
        return mine

    def commit(self, owner: Owner, keys: list[OffloadKey], ok: bool) -> None:
        """End the owner's reservations of `keys`: written (ready) or not (freed).
        Refused whole (not_owner) if any key is not the owner's; withdrawn ones are
        freed and reported `expired` after the others were committed."""
        unknown = [k for k in keys if k not in owner.reservations and k not in owner.withdrawn]
        if unknown:
            self.counters["not_owner"] += 1
            raise OwnerRefused(ErrorCode.NOT_OWNER, f"commit of key {unknown[0].hex()[:32]}: "
                               "this client has not reserved it")
        live = [k for k in dict.fromkeys(keys) if k in owner.reservations]
        late = [k for k in dict.fromkeys(keys) if k in owner.withdrawn]
        if live:
            self.complete_store(owner, live, ok)
            for key in live:
                del owner.reservations[key]
        if late:
            self.manager.primary.complete_store([owner.withdrawn.pop(k) for k in late], False)
        late = [k for k in late if k not in live]  # reserved again since: stored now
        if late:
            raise OwnerRefused(ErrorCode.EXPIRED, f"{len(late)} of the keys passed their "
                               f"reservation's deadline (broker.reservation_s="
                               f"{self.reservation_s:g}) and were not stored")

    def commit_as(self, owner: Owner, reserved: list[OffloadKey],
                  keys: list[OffloadKey]) -> list[bool]:
        """End the owner's reservations of `reserved` as written with the blocks of
        `keys` (co-indexed): each row becomes its key's block, ready, unless that key
        is present or being written already (the same bytes: the row is freed). A
        client keeps rows reserved under keys of its own choosing so that a store
        needs no round trip; this says what it wrote into them. Refused whole
        (not_owner) if any of `reserved` is not the owner's; per pair, whether the
        key's block is the one written."""
        unknown = [k for k in reserved
                   if k not in owner.reservations and k not in owner.withdrawn]
        if unknown or len(set(reserved)) != len(reserved):
            self.counters["not_owner"] += 1
            raise OwnerRefused(ErrorCode.NOT_OWNER, "commit_as of key "
                               f"{(unknown or reserved)[0].hex()[:32]}: this client has not "
                               "reserved it (or names it twice)")
        primary = self.manager.primary
        stored: list[OffloadKey] = []
        freed: list[OffloadKey] = []
        out: list[bool] = []
        for spare, key in zip(reserved, keys, strict=True):
            placeholder = owner.withdrawn.pop(spare, None)
            if placeholder is not None:  # past its deadline: its key is nobody's
                freed.append(placeholder)
                out.append(False)
                continue
            del owner.reservations[spare]
            renamed = primary.rename(spare, key)
            (stored if renamed else freed).append(key if renamed else spare)
            out.append(renamed)
        if freed:
            primary.complete_store(freed, False)
        if stored:
            self.complete_store(owner, stored, True)
        return out

    def complete_store(self, owner: Owner | None, keys: list[OffloadKey], ok: bool) -> None:
        """The manager's, with what it brought to the node counted (`arrivals`) as the
        owner's own (None: a store no live client made)."""
        changed = self.manager.complete_store(keys, ok)
        if ok and changed:
            self.arrivals.stored(owner, changed)

    # -- pins ------------------------------------------------------------------------

    def pinned(self, owner: Owner, keys: Iterable[OffloadKey], now: float) -> None:
        deadline = now + self.pin_s
        pins = owner.pins
        for key in keys:
            pin = pins.get(key)
            if pin is None:
                pins[key] = _Pin(1, deadline)
            else:
                pin.count += 1
                pin.deadline = deadline
            owner.expired_pins.discard(key)
        owner.next_due = min(owner.next_due, deadline)

    def release(self, owner: Owner, keys: list[OffloadKey]) -> None:
        """The owner read `keys`: its pins end. Refused whole (not_owner, expired) if it
        does not hold a pin for each."""
        wanted = Counter(keys)
        for key, n in wanted.items():
            pin = owner.pins.get(key)
            if pin is None or pin.count < n:
                if key in owner.expired_pins:
                    owner.expired_pins.discard(key)
                    raise OwnerRefused(ErrorCode.EXPIRED, f"release of key {key.hex()[:32]}: "
                                       f"its pin passed its deadline (broker.pin_s="
                                       f"{self.pin_s:g}) and was released")
                self.counters["not_owner"] += 1
                raise OwnerRefused(ErrorCode.NOT_OWNER, f"release of key {key.hex()[:32]}: "
                                   "this client has not pinned it")
        self.manager.complete_load(keys)
        for key, n in wanted.items():
            pin = owner.pins[key]
            pin.count -= n
            if not pin.count:
                del owner.pins[key]

    # -- deadlines and ends ------------------------------------------------------------------

    def credit(self, gap: float, now: float) -> None:
        """The broker did not listen for `gap` seconds: that silence is not the clients'."""
        for owner in self._owners.values():
            owner.last_seen = min(now, owner.last_seen + gap)

    def expire(self, now: float) -> None:
        """Owners silent past `owner_timeout_s` end; reservations and pins past their
        deadlines are withdrawn and released. A pass over every owner, so at most a
        few times a second (a flood of one-message connections makes many owners)."""
        if now < self._next_scan:
            return
        self._next_scan = now + min(SCAN_S, self.owner_timeout_s / 10, self.reservation_s / 10,
                                    self.pin_s / 10)
        for owner in list(self._owners.values()):
            if now - owner.last_seen > self.owner_timeout_s:
                self.counters["owners_timed_out"] += 1
                self.end(owner, f"silent for {now - owner.last_seen:.1f}s "
                         f"(broker.owner_timeout_s={self.owner_timeout_s:g})")
            elif now >= owner.next_due:
                self._expire_held(owner, now)

    def _expire_held(self, owner: Owner, now: float) -> None:
        primary = self.manager.primary
        late = [k for k, deadline in owner.reservations.items() if deadline <= now]
        for key in late:
            del owner.reservations[key]
            owner.withdrawn[key] = primary.withdraw(key)
        stale = [k for k, pin in owner.pins.items() if pin.deadline <= now]
        for key in stale:
            pin = owner.pins.pop(key)
            primary.release([key] * pin.count)
            owner.expired_pins.add(key)
        if len(owner.expired_pins) > 4 * self.quota_blocks:  # only a hint: bounded
            owner.expired_pins.clear()
        self.counters["reservations_withdrawn"] += len(late)
        self.counters["pins_expired"] += len(stale)
        owner.next_due = min([*owner.reservations.values(),
                              *(p.deadline for p in owner.pins.values()), float("inf")])
        if late or stale:
            log.warning("client %d: %d reservations withdrawn and %d pins released past their "
                        "deadlines", owner.number, len(late), len(stale))

    def end(self, owner: Owner, reason: str) -> None:
        """The owner is gone: what it held is let go, its requests finish."""
        if self._owners.pop(owner.identity, None) is None:
            return
        self.counters["owners_ended"] += 1
        self.arrivals.forget(owner)
        primary = self.manager.primary
        aborted = [*owner.reservations, *owner.withdrawn.values()]
        if owner.reservations:
            self.manager.complete_store(list(owner.reservations), False)
        if owner.withdrawn:
            primary.complete_store(list(owner.withdrawn.values()), False)
        pinned = [k for k, pin in owner.pins.items() for _ in range(pin.count)]
        if pinned:
            primary.release(pinned)
        self.counters["reservations_aborted"] += len(aborted)
        self.counters["pins_released_at_end"] += len(pinned)
        self._on_end(owner)
        if aborted or pinned:
            log.info("client %d ended (%s): %d reservations aborted, %d pins released",
                     owner.number, reason, len(aborted), len(pinned))

    def stats(self) -> dict[str, int]:
        return {"clients": len(self._owners), **self.counters}
