"""The SGLang backend's side of a tierkv node: one client, the mapped CPU region and
the pins it holds between SGLang's calls.

SGLang calls its storage backend from several threads of its cache controller: the
prefetch thread asks `batch_exists`, the prefetch I/O thread then reads the hits
(`batch_get_v1`), the backup thread writes (`batch_set_v1`). A tierkv `Client` is one
owner at the broker and not thread-safe, and pins are the owner's: one client serves
them all under one lock, so a pin taken by the exists query is the one the read
releases. Copies run under that lock too (the region may be swapped for a restarted
broker's between two calls); each copy lets the GIL go.

A pin SGLang never reads (a prefetch it revoked) is released once it is older than
half the broker's `pin_s`; the broker would release it at `pin_s` anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierkv.client import BrokerUnavailable, Client, Lookup, RemoteError
from tierkv.core.shm import RegionError, SharedRegion
from tierkv.sglang.pages import Pieces, RowView, page_intact, read_page, write_page

log = logging.getLogger("tierkv.sglang")

PENDING_POLL_S = 0.005  # between lookups while the node promotes from disk or S3


@dataclass(slots=True)
class _Held:
    row: int
    count: int  # pins of this key the broker counts for this client
    since: float
    region: str


@dataclass(frozen=True, slots=True)
class LinkOptions:
    address: str
    instance: str
    timeout_s: float = 5.0
    # How long a lookup waits for the node to bring blocks up from disk or S3: the
    # prefetch thread asks on its own thread, so waiting costs no engine step.
    lookup_wait_s: float = 2.0


class NodeLink:
    """Lookups, pinned reads and reserved writes of whole pages (see module docstring)."""

    def __init__(self, options: LinkOptions, client: Client) -> None:
        self.options = options
        self.client = client
        self._lock = threading.Lock()
        self._region: SharedRegion | None = None
        self._rows: np.ndarray | None = None
        self._held: dict[bytes, _Held] = {}
        self._pin_s = 300.0  # until a lookup says the broker's
        self.counters: Counter[str] = Counter()

    # -- the region --------------------------------------------------------------------

    def node_page_size(self) -> int:
        with self._lock:
            return self._attached("").layout.page_size

    def _attached(self, generation: str) -> SharedRegion:
        """The node's region, mapped again if the broker that answered serves another
        (`generation`: as a reply named it; "" takes the one there is)."""
        region = self._region
        if region is not None and (not generation or region.generation == generation):
            return region
        self._unmap()
        region = SharedRegion.attach(self.options.instance)
        if generation and region.generation != generation:
            region.close()
            raise RegionError(f"the node's region is {region.generation}, its broker "
                              f"answered for {generation}: restarting")
        self._region, self._rows = region, region.numpy()
        # Pins of the old broker name nothing in the new one.
        self._held = {k: h for k, h in self._held.items() if h.region == region.generation}
        return region

    def _unmap(self) -> None:
        self._rows = None  # the view goes before the map closes
        if self._region is not None:
            self._region.close()
            self._region = None

    def _row(self, row: int, page_bytes: int) -> RowView:
        assert self._rows is not None
        return RowView.of(self._rows, row, page_bytes)

    # -- lookups -----------------------------------------------------------------------

    def leading_hits(self, keys: list[bytes], pin: bool) -> int:
        """How many leading keys the node holds, after waiting (bounded) for those it
        is bringing up from a slower tier; `pin`: they stay pinned for the read."""
        if not keys:
            return 0
        with self._lock:
            self._release_stale()
            found = self._settled_lookup(keys)
            if not pin or not found.hits:
                return found.hits
            pinned = self.client.lookup(keys[:found.hits], pin=True)
            self._hold(keys, pinned)
            return pinned.hits

    def _settled_lookup(self, keys: list[bytes]) -> Lookup:
        deadline = time.monotonic() + self.options.lookup_wait_s
        while True:
            found = self.client.lookup(keys)
            if not found.pending or time.monotonic() >= deadline:
                return found
            time.sleep(PENDING_POLL_S)

    def _hold(self, keys: list[bytes], pinned: Lookup) -> None:
        self._pin_s = pinned.pin_s or self._pin_s
        now = time.monotonic()
        for key, row in zip(keys, pinned.rows or [], strict=False):
            if row < 0:
                break
            held = self._held.get(key)
            if held is not None and held.row == row and held.region == pinned.region:
                held.count += 1
                held.since = now
            else:
                if held is not None:  # the key moved rows: its old pins are the broker's
                    self._release_now({key: held.count})
                self._held[key] = _Held(row, 1, now, pinned.region)

    def _release_stale(self) -> None:
        now = time.monotonic()
        stale = {k: h.count for k, h in self._held.items() if now - h.since > self._pin_s / 2}
        if stale:
            for key in stale:
                del self._held[key]
            self._release_now(stale)

    def _release_now(self, counts: dict[bytes, int]) -> None:
        keys = [key for key, n in counts.items() for _ in range(n)]
        try:
            self.client.release(keys)
        except RemoteError as e:  # expired or a new broker's: nothing to give back
            log.debug("[sglang] release of %d pins refused: %s", len(keys), e)

    # -- reads -------------------------------------------------------------------------

    def read(self, keys: list[bytes], pages: list[Pieces], payload: int) -> list[bool]:
        """Copy the node's verified pages of `keys` into the host pages; per key
        whether it landed. A key the node lacks, or whose row fails its check, is a
        miss, and so is every key after it (SGLang reads a prefix)."""
        with self._lock:
            rows = self._rows_for(keys)
            out = [False] * len(keys)
            region = self._attached(rows[0][1]) if rows else None
            for i, (row, generation) in enumerate(rows):
                if region is None or generation != region.generation:
                    break
                view = self._row(row, payload)
                if not page_intact(view, keys[i], payload):
                    self.counters["pages_failed_check"] += 1
                    log.warning("[sglang] page %s failed its check: read as a miss",
                                keys[i].hex()[:24])
                    break
                read_page(view, pages[i])
                out[i] = True
            self._let_go(keys[:len(rows)])
            self.counters["pages_read"] += sum(out)
            self.counters["pages_missed"] += len(keys) - sum(out)
            return out

    def _rows_for(self, keys: list[bytes]) -> list[tuple[int, str]]:
        """(row, region) of the leading keys, pinned: by the exists query that came
        before, or now."""
        rows: list[tuple[int, str]] = []
        for key in keys:
            held = self._held.get(key)
            if held is None:
                break
            rows.append((held.row, held.region))
        rest = keys[len(rows):]
        if rest:
            pinned = self.client.lookup(rest, pin=True)
            self._hold(rest, pinned)
            rows.extend((self._held[k].row, self._held[k].region)
                        for k in rest[:pinned.hits])
        return rows

    def _let_go(self, keys: list[bytes]) -> None:
        """Release every pin this client holds on `keys` (a completed read is a use)."""
        counts = {k: self._held.pop(k).count for k in dict.fromkeys(keys) if k in self._held}
        if counts:
            self._release_now(counts)

    # -- writes ------------------------------------------------------------------------

    def write(self, keys: list[bytes], pages: list[Pieces], payload: int) -> list[bool]:
        """Reserve rows for `keys`, copy the host pages and their checks in, commit.
        True for a key the node now holds or chose not to keep (present already, or
        not admitted); all False when it had no room."""
        with self._lock:
            reserved = self.client.reserve(keys)
            if not reserved.ok:
                self.counters["pages_refused"] += len(keys)
                return [False] * len(keys)
            todo = [(k, row, p) for k, row, p in zip(keys, reserved.block_ids, pages,
                                                     strict=True) if row >= 0]
            if not todo:
                return [True] * len(keys)
            written = [k for k, _, _ in todo]
            try:
                self._attached(reserved.region)
                for key, row, pieces in todo:
                    write_page(self._row(row, payload), key, pieces)
            except BaseException:
                self._commit_quietly(written, False, reserved.region)
                raise
            self.client.commit(written, True, reserved.region)
            self.counters["pages_written"] += len(written)
            return [True] * len(keys)

    def _commit_quietly(self, keys: list[bytes], ok: bool, region: str) -> None:
        try:
            self.client.commit(keys, ok, region)
        except (RemoteError, BrokerUnavailable) as e:
            log.warning("[sglang] could not abort %d reserved rows: %s", len(keys), e)

    # -- the end -----------------------------------------------------------------------

    def close(self) -> None:
        """Let go of every pin and the region, and say goodbye to the broker."""
        with self._lock:
            self._held.clear()  # the goodbye releases them
            self._unmap()
            self.client.close()


def guarded(what: str, default: Callable[[], object]) -> Callable:
    """For SGLang's storage threads, which treat any exception as the end of their
    loop: an unreachable broker is logged and answered with `default()` (a miss, a
    failed write), everything else raises."""
    def wrap(method: Callable) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            try:
                return method(*args, **kwargs)
            except (BrokerUnavailable, RegionError) as e:
                log.warning("[sglang] %s: the tierkv node did not answer (%s)", what, e)
                return default()
        call.__name__ = method.__name__
        call.__doc__ = method.__doc__
        return call
    return wrap
