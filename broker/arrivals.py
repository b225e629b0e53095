"""What arrived at the node, per scope of keys: the count every reply says
(`OpsResult.arrivals`), so that a client may keep the misses it was told instead of
asking about them again.

A key no tier holds becomes a hit only when a client stores it, or when a tier comes
to hold it otherwise (`TieringManager.arrivals`: a tier process back with its
inventory, another node's store in a shared tier's listing). A client names the
scope of its keys with each request (`OpsRequest.scope`: the prefix every key of
its namespace starts with; empty, every key). Per scope a live client names, the
broker counts the keys under it that clients' stores brought to the CPU tier, and
per client its own among them; a reply says the scope's count less the client's own,
plus what the tiers came to hold otherwise (counted for every scope: that is rare,
and a tier cannot say whose a key is). So another engine's store in the same
namespace moves a client's count, one in another namespace does not, and its own
never does (it knows what it stored).

A scope lives while a live client names it: counts are as many as clients, and a
scope's count never starts again under a client that was told it. A reply's value
also carries the client's number (`OWNER_SHIFT`), so a client that reconnects (a
new owner, its own stores counted from 0) is never told a value it was told before.

Socket-free, on the broker's one thread.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from tierkv.core.keys import OffloadKey

if TYPE_CHECKING:
    from broker.owners import Owner
    from tierkv.core.tiering import TieringManager

OWNER_SHIFT = 40  # a reply's value: the owner's number above, the count below


class Arrivals:
    """The counts of the scopes live clients name (see the module docstring)."""

    def __init__(self, manager: TieringManager) -> None:
        self._manager = manager
        self._counts: dict[bytes, int] = {}  # scope -> keys clients' stores brought
        self._named: Counter[bytes] = Counter()  # scope -> live clients naming it
        self._lengths: Counter[int] = Counter()  # length -> named scopes that long

    def name(self, owner: Owner, scope: bytes) -> None:
        """The scope `owner`'s request named (most name the same one every time)."""
        if owner.key_scope == scope:
            return
        self.forget(owner)
        owner.key_scope, owner.own_arrivals = scope, 0
        if not self._named[scope]:
            self._counts[scope] = 0
            self._lengths[len(scope)] += 1
        self._named[scope] += 1

    def forget(self, owner: Owner) -> None:
        """The owner names its scope no more (it names another, or it ended)."""
        scope, owner.key_scope = owner.key_scope, None
        if scope is None:
            return
        self._named[scope] -= 1
        if not self._named[scope]:
            del self._named[scope], self._counts[scope]
            self._lengths[len(scope)] -= 1
            if not self._lengths[len(scope)]:
                del self._lengths[len(scope)]

    def stored(self, owner: Owner | None, keys: list[OffloadKey]) -> None:
        """`keys` came to the CPU tier by a store of `owner` (None: of none known)."""
        counts = self._counts
        for length in self._lengths:
            for key in keys:
                scope = key[:length]
                if scope in counts:
                    counts[scope] += 1
        own = owner.key_scope if owner is not None else None
        if owner is not None and own is not None:
            owner.own_arrivals += sum(1 for key in keys if key.startswith(own))

    def count(self, owner: Owner) -> int | None:
        """What `owner`'s reply says (None: a tier cannot tell what arrives in it)."""
        found = self._manager.arrivals
        if found is None or owner.key_scope is None:
            return None
        count = self._counts[owner.key_scope] - owner.own_arrivals + found
        return (owner.number << OWNER_SHIFT) + count
