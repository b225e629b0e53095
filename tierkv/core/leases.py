"""Leases: CPU blocks a request was told about, kept for it until it reads them.

A lookup that reports hits to a request, and a promotion that lands for one, lease
those blocks to the request: each leased block holds one reader (`PrimaryTier.acquire`),
so no other request or engine can evict it between the lookup and the load. A
lease ends when the request loads the block (the load's own reader takes over),
when the request finishes, or `lease_s` after the request last looked (a request
an engine forgot must not hold blocks forever).

Cost: a request looked up again (an engine asks about a waiting request at every
step) only refreshes its lease; the per-key work is done once per block and request.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from tierkv.core.keys import OffloadKey
from tierkv.core.primary import PrimaryTier

ReqId = str


class _Lease:
    __slots__ = ("expiry", "keys")

    def __init__(self) -> None:
        self.keys: dict[OffloadKey, None] = {}  # insertion order: the request's prefix
        self.expiry = 0.0


class Leases:
    def __init__(self, primary: PrimaryTier, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.primary = primary
        self.lease_s = lease_s
        self.clock = clock
        self._leases: OrderedDict[ReqId, _Lease] = OrderedDict()  # oldest expiry first
        self.expired = 0  # blocks whose lease ran out

    def lease(self, req_id: ReqId, keys: Sequence[OffloadKey]) -> None:
        """Lease ready `keys` to `req_id` (those it holds already are refreshed)."""
        lease = self._leases.get(req_id)
        if lease is None:
            lease = self._leases[req_id] = _Lease()
        else:
            self._leases.move_to_end(req_id)
        lease.expiry = self.clock() + self.lease_s
        held = lease.keys
        if not keys or (len(held) >= len(keys) and keys[-1] in held and keys[0] in held):
            return  # the same prefix asked for again: nothing new to hold
        new = [k for k in dict.fromkeys(keys) if k not in held]
        if new:
            self.primary.acquire(new)
            held.update(dict.fromkeys(new))

    def take(self, req_id: ReqId | None, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The request reads `keys` now: their leased readers pass to the caller (who
        releases them once its own readers hold the blocks). Returns those keys."""
        lease = self._leases.get(req_id) if req_id is not None else None
        if lease is None:
            return []
        held = lease.keys
        mine = [k for k in keys if held.pop(k, 0) is None]
        if not held:
            del self._leases[req_id]  # type: ignore[arg-type]
        return mine

    def end(self, req_id: ReqId) -> None:
        """The request finished: its blocks may go."""
        lease = self._leases.pop(req_id, None)
        if lease is not None and lease.keys:
            self.primary.release(list(lease.keys))

    def expire(self) -> None:
        now = self.clock()
        leases = self._leases
        while leases:
            req_id, lease = next(iter(leases.items()))
            if lease.expiry > now:
                return
            del leases[req_id]
            self.expired += len(lease.keys)
            self.primary.release(list(lease.keys))

    def clear(self) -> None:
        for req_id in list(self._leases):
            self.end(req_id)

    def requests(self) -> list[ReqId]:
        return list(self._leases)

    def held_keys(self) -> Iterator[OffloadKey]:
        """Every leased block, once per lease that holds it (each owes one reader)."""
        for lease in self._leases.values():
            yield from lease.keys

    def __len__(self) -> int:
        return sum(len(lease.keys) for lease in self._leases.values())

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._leases

    def of(self, req_id: ReqId) -> list[OffloadKey]:
        lease = self._leases.get(req_id)
        return list(lease.keys) if lease is not None else []
