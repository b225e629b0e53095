"""What this engine holds at the tierkv broker, and what it still owes it.

It holds *pins* (rows the broker keeps for its reads: every hit it was told of is
pinned in the broker pass that found it) and *reservations* (rows its store jobs
write, one entry per vLLM chunk, naming the request whose job writes it). It owes
the broker what it learned since the last round trip: commits of stores that ended,
releases of pins it no longer needs, touches, finished requests, request contexts.

Nothing owed is ever dropped silently. It rides the next round trip; if that round
trip gets no reply (the broker is slow or gone), what it carried is owed again,
under one rule that keeps a repeat harmless: the broker applies or refuses each
commit or release group whole, and refuses (`not_owner`) one that names a key its
sender no longer holds, so a group sent again is kept whole and apart from new ones,
a commit is sent again only while its keys stay out of new reservations
(`committing`), and a release is sent again only when this engine holds no other
pin of those keys (a repeat could end that pin, and a row still being read could
be reused). A release that cannot be repeated is logged; the broker releases that
pin after `broker.pin_s`. What a lost round trip itself did (the pins of its
lookups, the rows of its reservations) is unknown: the rows are aborted key by key
(a group per key, so a key that is not ours does not block the others), the pins
are left to `broker.pin_s`.

Runs on the scheduler thread, under the manager's lock.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv.client import Batch, RemoteError
from tierkv.core.errors import ErrorCode
from tierkv.core.loglimit import RateLimitedLog
from tierkv.wire.protocol import RequestContext

log = logging.getLogger("tierkv.vllm")


@dataclass(slots=True)
class Reservation:
    """The tierkv keys reserved for one vLLM chunk, and the request whose store job
    writes them: only that job's completion commits them."""

    req_id: str
    keys: list[bytes]
    written_as: bytes | None = None  # a spare row (`spares.py`): the key it is written with


@dataclass(slots=True)
class _Group:
    keys: list[bytes]
    ok: bool = True  # commits: written (ready) or not (freed)
    again: bool = False  # sent before, its reply lost: a refusal is expected
    written_as: list[bytes] = field(default_factory=list)  # commits of spares: their keys


@dataclass(slots=True)
class Owed:
    """Operations for the next round trip (see the module docstring)."""

    commits: list[_Group] = field(default_factory=list)
    commits_as: list[_Group] = field(default_factory=list)
    releases: list[_Group] = field(default_factory=list)
    touches: list[bytes] = field(default_factory=list)
    finishes: list[str] = field(default_factory=list)
    contexts: list[RequestContext] = field(default_factory=list)
    since: float = 0.0  # when the oldest of them was owed

    def __bool__(self) -> bool:
        return bool(self.commits or self.commits_as or self.releases or self.touches
                    or self.finishes or self.contexts)

    def add_to(self, batch: Batch) -> int:
        """Put them first in `batch`; returns how many result slots they take."""
        for group in self.commits:
            batch.commit(group.keys, group.ok)
        for group in self.commits_as:
            batch.commit_as(group.keys, group.written_as)
        for group in self.releases:
            batch.release(group.keys)
        if self.touches:
            batch.touch(self.touches)
        for context in self.contexts:
            batch.context(context)
        for req_id in self.finishes:
            batch.finish(req_id)
        return (len(self.commits) + len(self.commits_as) + len(self.releases)
                + bool(self.touches) + len(self.finishes))


class Holdings:
    """Pins, reservations and owed operations of one engine (one broker owner)."""

    def __init__(self) -> None:
        self.pins: Counter[bytes] = Counter()  # pins held and not yet owed a release
        self.writing: dict[bytes, Reservation] = {}  # vLLM chunk key -> its reservation
        self.committing: set[bytes] = set()  # tierkv keys whose commit is not confirmed
        self.owed = Owed()
        self._fresh_commit: dict[bool, _Group] = {}  # this round's commit group per ok
        self._fresh_commit_as: _Group | None = None
        self._fresh_release: _Group | None = None
        self._warn = RateLimitedLog(log)

    # -- what happens ---------------------------------------------------------------------

    def pinned(self, keys: Iterable[bytes]) -> None:
        """A lookup's reply pinned `keys` (one pin each)."""
        self.pins.update(keys)

    def release(self, keys: Sequence[bytes]) -> None:
        """Owe a release of one pin of each of `keys`."""
        if not keys:
            return
        for key in keys:
            left = self.pins[key] - 1
            if left > 0:
                self.pins[key] = left
            else:
                del self.pins[key]
        if self._fresh_release is None:
            self._fresh_release = _Group([])
            self._owe().releases.append(self._fresh_release)
        self._fresh_release.keys.extend(keys)

    def reserved(self, chunk: bytes, req_id: str, keys: list[bytes],
                 written_as: bytes | None = None) -> None:
        self.writing[chunk] = Reservation(req_id, keys, written_as)

    def busy(self, chunk: bytes, keys: Iterable[bytes]) -> bool:
        """Whether a store of `chunk` would clash with this engine's own: it is being
        written, or a commit of one of its keys is not confirmed yet."""
        if chunk in self.writing:
            return True
        committing = self.committing
        for key in keys:  # a loop, not any(): a store asks this of every chunk offered
            if key in committing:
                return True
        return False

    def end_store(self, chunk: bytes, req_id: str | None, ok: bool) -> bytes | None:
        """The store job of `req_id` (None: whichever) that writes `chunk` ended: owe
        its commit. Returns the tierkv key written (None if that job reserved nothing
        for it)."""
        held = self.writing.get(chunk)
        if held is None or (req_id is not None and held.req_id != req_id):
            return None
        del self.writing[chunk]
        if ok and held.written_as is not None:
            self.commit_as(held.keys, [held.written_as])
        else:
            self.commit(held.keys, ok)
        return held.written_as or held.keys[0]

    def commit_as(self, spares: list[bytes], keys: list[bytes]) -> None:
        """Owe the commit of spare rows written with the blocks of `keys`."""
        group = self._fresh_commit_as
        if group is None:
            group = self._fresh_commit_as = _Group([])
            self._owe().commits_as.append(group)
        group.keys.extend(spares)
        group.written_as.extend(keys)
        self.committing.update(keys)

    def commit(self, keys: list[bytes], ok: bool) -> None:
        if not keys:
            return
        group = self._fresh_commit.get(ok)
        if group is None:
            group = self._fresh_commit[ok] = _Group([], ok)
            self._owe().commits.append(group)
        group.keys.extend(keys)
        self.committing.update(keys)

    def touch(self, keys: Iterable[bytes]) -> None:
        self._owe().touches.extend(keys)

    def finish(self, req_id: str) -> None:
        self._owe().finishes.append(req_id)

    def context(self, context: RequestContext) -> None:
        self._owe().contexts.append(context)

    def let_go_of_everything(self) -> None:
        """Owe the abort of every reservation and the release of every pin (the engine
        stops, or forgets what it had)."""
        for chunk in list(self.writing):
            self.end_store(chunk, None, False)
        self.release(list(self.pins.elements()))

    # -- round trips ----------------------------------------------------------------------

    def take(self) -> Owed:
        """What a round trip carries now (owed afresh from here on)."""
        owed, self.owed = self.owed, Owed()
        self._fresh_commit.clear()
        self._fresh_commit_as = None
        self._fresh_release = None
        return owed

    def settle(self, owed: Owed, results: Sequence[Any] | None) -> None:
        """`owed` went out: `results` are its slots of the reply, None if no reply came
        (then it is owed again, as the module docstring says)."""
        if results is None:
            self._owe_again(owed)
            return
        at = 0
        for group in owed.commits:
            if self._settled("commit", group, results[at]):
                self.committing.difference_update(group.keys)
            at += 1
        for group in owed.commits_as:
            if self._settled("commit", group, results[at]):
                self.committing.difference_update(group.written_as)
            at += 1
        for group in owed.releases:
            self._settled("release", group, results[at])
            at += 1

    def lost_reservations(self, keys: Iterable[bytes]) -> None:
        """A reserve whose reply was lost: abort whatever it got, key by key."""
        for key in keys:
            self._owe().commits.append(_Group([key], False, again=True))
            self.committing.add(key)

    def given_up(self, keys: Iterable[bytes]) -> None:
        """A reserve nobody waited for got rows for `keys`: abort them, key by key,
        except those a later reserve of this engine got again (the broker renews an
        owner's own reservation and gives its row again): a store writes into those."""
        in_use = self.committing.union(*(r.keys for r in self.writing.values()))
        self.lost_reservations(k for k in keys if k not in in_use)

    def _owe_again(self, owed: Owed) -> None:
        target = self._owe()
        for group in owed.commits:
            group.again = True
            target.commits.append(group)
        for group in owed.commits_as:
            group.again = True
            target.commits_as.append(group)
        for group in owed.releases:
            if any(self.pins[k] for k in group.keys):
                log.warning("tierkv: a release of %d pins got no reply and cannot be sent "
                            "again while this engine holds other pins of those blocks; the "
                            "broker releases them after broker.pin_s", len(group.keys))
                continue
            group.again = True
            target.releases.append(group)
        target.finishes.extend(owed.finishes)
        # Touches and contexts are advice: a lost one costs nothing but a better guess.

    def _settled(self, what: str, group: _Group, result: Any) -> bool:
        """Whether `group` is done with. A commit of several keys refused `not_owner`
        changed nothing at the broker: its keys are owed again one by one, so the key
        that is not this engine's costs only itself (a commit refused whole left the
        others reserved, pending for every engine until `broker.reservation_s`). A
        release is not: this engine may pin those keys again meanwhile, and a
        release sent then would end the new pin (the broker ends them at `pin_s`)."""
        if not isinstance(result, RemoteError):
            return True
        if group.again and result.code == ErrorCode.NOT_OWNER.value:
            return True  # the lost first try was applied
        if result.code == ErrorCode.EXPIRED.value:
            self._warn.warning(f"{what}-expired", "tierkv: %s after the broker's deadline: "
                               "%s", what, result.message)
            return True
        self._warn.warning(what, "tierkv refused a %s: %s", what, result)
        if what != "commit" or result.code != ErrorCode.NOT_OWNER.value or len(group.keys) < 2:
            return True
        owed = self._owe()
        singles = owed.commits_as if group.written_as else owed.commits
        for i, key in enumerate(group.keys):
            singles.append(_Group([key], group.ok, again=True,
                                  written_as=group.written_as[i:i + 1]))
        return False

    def _owe(self) -> Owed:
        owed = self.owed
        if not owed:
            owed.since = time.monotonic()
        return owed
