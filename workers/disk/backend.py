"""The disk tier: blocks in preallocated slab files of fixed-size slots.

Runs inside a tier process (`tierkv-tier --type disk`); every public method is
called from the runner's I/O threads and may block.

Layout, under `<root>/ns-<slug>-<hash>/` (one directory per namespace, so two
models never share a slot, and neither a namespace nor a key ever becomes a path)::

    slab-00000.dat  slab-00001.dat ...   fixed-size slots, preallocated
    slot = [ block header, padded to 4 KiB ][ payload, padded to 4 KiB ]
    meta.json                            geometry, checked at every start
    lock                                 flock: one process per directory

Why slabs: a file per block (create, write, fsync, rename) measured 0.2-0.36 GB/s
durable and an unlink per eviction ~0.16 ms; `pwritev` at offsets into one
preallocated file ~1.8 GB/s. Why 4 KiB padding: the payload then sits at an aligned
offset, so `O_DIRECT` can move it. Slots handed out together are adjacent, so a
job's blocks move in runs: one request per run of adjacent slots, through a
huge-page staging buffer per I/O thread (`workers.disk.runs` says why).

Crash safety without rename: a block is only ever written into a free slot, its
header (`tierkv.core.blockformat`) checksums itself and the payload, and a store
returns only after `fdatasync` (shared by concurrent stores: group commit). A crash
leaves whole valid blocks and slots that do not validate, which count as free. A
slot that is freed while its block is still valid (delete, corrupt, replaced copy)
gets its header zeroed so a restart cannot bring that block back; two valid copies
of a key (a crash between writing the new and zeroing the old) resolve to the
higher write sequence number.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Container, Iterable, Sequence
from pathlib import Path
from typing import Any, cast

from tierkv.core.blockformat import (
    MAX_KEY,
    CorruptBlock,
)
from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.keys import OffloadKey
from tierkv.tiers.backend import TierBackend, detached
from tierkv.tiers.lru import LRUIndex
from tierkv.tiers.registry import TierConfigError
from workers.disk.commit import GroupCommit
from workers.disk.layout import (
    PAGE,
    ZERO_HEADER,
    buffer_address,
    check_root,
    io_error,
    namespace_dir,
    namespace_tag,
    slot_bytes_for,
)
from workers.disk.options import DEFAULT_RUN_BYTES, DEFAULT_SLAB_BYTES, OPTIONS
from workers.disk.runs import Entry, Item, RunIO
from workers.disk.slabs import SlabFiles, SlabGrowthFailed
from workers.disk.startup import check_meta, choose_direct, scan_slots

log = logging.getLogger("tierkv.disk")

# How often a tier that holds less than its budget (its filesystem had too little
# room) asks it again for space, when a store finds the tier full: a statvfs is
# cheap, but a store that evicts should not pay for one every time.
GROW_RETRY_S = 5.0


class DiskBackend(TierBackend):
    """Bounded, LRU by last use, durable, verified on every load.

    Metadata (index in LRU order, free list, readers per slot) sits behind one lock
    that is never held during I/O. A slot being read is neither evicted nor reused
    until its readers leave.
    """

    type_name = "disk"
    options = OPTIONS  # the constructor's keyword arguments, checked before start

    def __init__(
        self,
        root: str,
        budget_bytes: int,
        block_bytes: int,
        namespace: str = "default",
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        durable: bool = True,
        o_direct: str | bool = "auto",
        group_commit: bool = True,
        sync_per: str = "job",
        run_bytes: int = DEFAULT_RUN_BYTES,
        staging: bool = True,
    ) -> None:
        """`root` must exist (a missing or unwritable root fails here, clearly).
        `budget_bytes` fixes the number of slots; `slab_bytes` how many share a file.
        `durable=False` skips fdatasync (benchmarks; a crash may then lose blocks the
        broker was told are stored). `o_direct`: "auto" uses it where the filesystem
        and block size allow, True insists, False never. `group_commit=False` makes
        each store call fdatasync on its own (for comparison). `sync_per="job"` (the
        default) makes a whole store job durable with one flush per slab file, when
        the tier process reports it (`sync`); "store" flushes inside every `store`.
        `run_bytes`: how many bytes of a job one I/O thread moves at once (adjacent
        slots in one `preadv`/`pwritev`; 0 or less than a block: a block at a time).
        `staging`: O_DIRECT runs go through a huge-page buffer per thread
        (`workers.disk.runs` says why); false: straight to and from the rows."""
        if sync_per not in ("job", "store"):
            raise TierConfigError(f"disk tier: sync_per must be 'job' or 'store', "
                                  f"got {sync_per!r}")
        self.sync_per = sync_per
        self._written: set[int] = set()  # slab descriptors that `sync` must flush
        if o_direct not in ("auto", True, False):
            raise TierConfigError(f"disk tier: o_direct must be 'auto', true or false, "
                                  f"got {o_direct!r}")
        if type(block_bytes) is not int or block_bytes <= 0:
            raise TierConfigError(f"disk tier: block_bytes must be positive, got {block_bytes!r}")
        self.block_bytes = block_bytes
        self.slot_bytes = slot_bytes_for(block_bytes)
        if type(budget_bytes) is not int or budget_bytes < self.slot_bytes:
            raise TierConfigError(f"disk tier: budget_bytes must be an integer of at least one "
                                  f"slot ({self.slot_bytes} bytes), got {budget_bytes!r}")
        if type(run_bytes) is not int or run_bytes < 0:
            raise TierConfigError(f"disk tier: run_bytes must be 0 or more, got {run_bytes!r}")
        self.run_bytes = run_bytes
        self.staging = bool(staging)
        self._io: RunIO | None = None
        if type(slab_bytes) is not int or slab_bytes <= 0:
            raise TierConfigError(f"disk tier: slab_bytes must be positive, got {slab_bytes!r}")
        self.namespace = namespace
        self._ns = namespace_tag(namespace)
        self.directory = check_root(Path(root)) / namespace_dir(namespace)
        self._lock_fd = -1
        self._slabs: SlabFiles | None = None
        self._lock = threading.Lock()
        self._index: LRUIndex[Entry] = LRUIndex(self._lock)
        self._free: list[int] = []
        self._fresh = 0  # slots from here on were never handed out (their slab may not exist)
        self._usable = 0  # slots below this may be used: the capacity, what of the budget fits
        self.grow_retry_s = GROW_RETRY_S
        self._grow_after = 0.0  # monotonic time before which no growth is tried
        self._readers: dict[int, int] = {}
        self._retired: set[int] = set()  # freed while read: released by the last reader
        self._seq = 0
        self._counts = dict.fromkeys(("stores", "loads", "corrupt_blocks", "evictions",
                                      "enospc_failures", "invalid_slots_at_start"), 0)
        self.commit = GroupCommit(durable, group_commit)
        try:
            self._open_directory(slab_bytes, budget_bytes, o_direct)
            self._scan()
        except BaseException:
            self.close()
            raise

    # -- start-up --------------------------------------------------------------------

    def _open_directory(self, slab_bytes: int, budget_bytes: int, o_direct: str | bool) -> None:
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)
            self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                    0o600)
        except OSError as e:
            raise TierError(ErrorCode.FATAL, f"disk tier root {self.directory.parent} is not "
                                             f"writable: {e.strerror or e}") from e
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TierError(ErrorCode.FATAL, f"disk tier directory {self.directory} is in use "
                                             f"by another tier process") from None
        slots_per_slab = check_meta(self.directory, self.block_bytes, self.slot_bytes,
                                    max(1, slab_bytes // self.slot_bytes), self.namespace)
        self.direct = choose_direct(self.directory, self.block_bytes, o_direct)
        total = budget_bytes // self.slot_bytes
        self._slabs = SlabFiles(self.directory, self.slot_bytes, slots_per_slab, total,
                                self.direct)
        self._slabs.fit_to_budget()
        self._io = RunIO(self._slabs, self.block_bytes, self.slot_bytes, self._ns,
                         self.run_bytes // self.slot_bytes, self.staging and self.direct)

    def _scan(self) -> None:
        """Rebuild the index from slot headers (`workers.disk.startup.scan_slots`)."""
        slabs = self._require()
        t0 = time.monotonic()
        scan = scan_slots(slabs, self._ns, self.block_bytes)
        self._free.extend(scan.free)
        self._counts["invalid_slots_at_start"] += scan.invalid
        for key, kept in sorted(scan.found.items(), key=lambda item: item[1].seq):
            self._index[key] = kept
        self._seq = max((e.seq for e in scan.found.values()), default=0)
        self._fresh = slabs.backed_end()
        self._usable = self._fitting()
        self._free.sort(reverse=True)  # pop() hands out low slots first
        for slot in scan.stale:
            self._release(slot)
        log.info("disk tier %s: %d blocks in %d slots (%d free, capacity %d of the budget's "
                 "%d) in %.2fs", self.directory, len(self._index), scan.scanned, len(self._free),
                 self._usable, slabs.total_slots, time.monotonic() - t0)
        if self._usable < slabs.total_slots:
            self._say_what_fits()

    def _fitting(self) -> int:
        """Slots the tier can have now: those with their space, and as many more
        as the filesystem has room for (less a headroom), within the budget."""
        slabs = self._require()
        room = slabs.room_slots()
        if room is None:
            return slabs.total_slots
        return min(slabs.total_slots, slabs.backed_end() + room)

    def _say_what_fits(self) -> None:
        """One line at start for a budget the filesystem cannot hold: the tier
        runs smaller, not empty, and an operator sees by how much."""
        slabs = self._require()
        log.warning("disk tier %s: only %d of the budget's %d slots fit on its "
                    "filesystem (%.1f MiB of %.1f MiB); it grows as space frees",
                    self.directory, self._usable, slabs.total_slots,
                    self._usable * slabs.slot_bytes / 2**20,
                    slabs.total_slots * slabs.slot_bytes / 2**20)

    # -- TierBackend -----------------------------------------------------------------

    def store(self, key: OffloadKey, src: memoryview, pinned: Container[OffloadKey] = ()) -> None:
        errors = self.store_many((key,), (src,), pinned)
        if errors[0] is not None:
            raise cast(TierError, errors.pop())  # bound to no name: no cycle with its traceback

    def store_many(self, keys: Sequence[OffloadKey], srcs: Sequence[memoryview],
                   pinned: Container[OffloadKey] = ()) -> list[TierError | None]:
        """Slots for the keys in one round of the lock (adjacent when the free list
        or the fresh slots allow), then one request per run of adjacent slots.

        A key that finds no slot while this call still writes others waits for
        them to land and asks again (a wave): a small tier then holds what a
        block-at-a-time store would, not less because a run was in flight."""
        errors: list[TierError | None] = [None] * len(keys)
        waiting: list[int] = []
        for i, (key, src) in enumerate(zip(keys, srcs, strict=True)):
            if len(src) != self.block_bytes:
                errors[i] = self._size_error(src, "store")
            elif not 0 < len(key) <= MAX_KEY:
                errors[i] = TierError(ErrorCode.BAD_REQUEST,
                                      f"keys are 1..{MAX_KEY} bytes, got {len(key)}")
            else:
                waiting.append(i)
        while waiting:
            self._grow_when_full()
            todo: list[Item] = []
            later: list[int] = []
            with self._lock:
                for n, i in enumerate(waiting):
                    try:
                        slot = self._take_slot(keys[i], pinned)
                    except TierError as e:
                        if todo:  # after this wave's blocks are in
                            later = waiting[n:]
                            break
                        errors[i] = detached(e)
                        continue
                    self._seq += 1
                    todo.append(Item(i, Entry(slot, self._seq), self._direct_ok(srcs[i])))
            self._write_wave(todo, keys, srcs, errors)
            waiting = later
        return errors

    def _write_wave(self, todo: list[Item], keys: Sequence[OffloadKey],
                    srcs: Sequence[memoryview], errors: list[TierError | None]) -> None:
        """Write the items (slots taken), then install each one that was written
        and free the slot of each one that was not."""
        finished = False
        try:
            for run in self._run_io().runs(todo):
                try:
                    self._give_space(run)
                    fd = self._run_io().write(run, keys, srcs)
                    if self.sync_per == "store":
                        self.commit.commit(fd)
                    else:
                        with self._lock:
                            self._written.add(fd)
                except OSError as e:
                    for item in run:
                        errors[item.at] = self._counted(detached(io_error(
                            e, f"store of {keys[item.at].hex()} failed")))
                except TierError as e:
                    if isinstance(e, SlabGrowthFailed) and e.code is ErrorCode.NO_SPACE:
                        self._stop_growing(e.slab, e.backed)
                    for item in run:
                        errors[item.at] = self._counted(detached(e))
            finished = True
        finally:  # also on a BaseException: no slot stays taken by a store that ended
            for item in todo:
                if errors[item.at] is not None or not finished:
                    self._release(item.entry.slot)
                    continue
                with self._lock:
                    self._counts["stores"] += 1
                    replaced = self._install(keys[item.at], item.entry)
                if replaced is not None:
                    self._retire(replaced)

    def sync(self) -> None:
        """Everything written before this call is durable when it returns. Flushes
        every slab file written so far (a clean one costs next to nothing), through
        the group committer, so concurrent jobs share their fdatasyncs."""
        with self._lock:
            fds = list(self._written)
        try:
            for fd in fds:
                self.commit.commit(fd)
        except OSError as e:
            raise self._counted(io_error(e, "making stores durable failed")) from e

    def load(self, key: OffloadKey, dst: memoryview) -> None:
        errors = self.load_many((key,), (dst,))
        if errors[0] is not None:
            raise cast(TierError, errors.pop())  # bound to no name: no cycle with its traceback

    def load_many(self, keys: Sequence[OffloadKey],
                  dsts: Sequence[memoryview]) -> list[TierError | None]:
        """One `preadv` per run of adjacent slots (`RunIO.read`), then every block
        verified on its own: a bad one fails its key only (and leaves the index),
        never its neighbours."""
        errors: list[TierError | None] = [None] * len(keys)
        todo: list[Item] = []
        with self._lock:
            for i, (key, dst) in enumerate(zip(keys, dsts, strict=True)):
                if len(dst) != self.block_bytes:
                    errors[i] = self._size_error(dst, "load")
                    continue
                entry = self._index.get(key)
                if entry is None:
                    errors[i] = TierError(ErrorCode.NOT_FOUND,
                                          f"key {key.hex()} is not in the disk tier")
                    continue
                self._index.move_to_end(key)
                self._readers[entry.slot] = self._readers.get(entry.slot, 0) + 1
                todo.append(Item(i, entry, False))
        try:
            todo = [item._replace(direct=self._direct_ok(dsts[item.at])) for item in todo]
            for run in self._run_io().runs(todo):
                try:
                    found = self._run_io().read(run, keys, dsts)
                except OSError as e:
                    for item in run:
                        errors[item.at] = detached(io_error(
                            e, f"load of {keys[item.at].hex()} failed"))
                    continue
                for item, problem in zip(run, found, strict=True):
                    if problem is None:
                        continue
                    key = keys[item.at]
                    self._condemn(key, item.entry)
                    log.warning("disk tier: corrupt block of key %s in slot %d: %s",
                                key.hex(), item.entry.slot, problem.message)
                    errors[item.at] = CorruptBlock(f"key {key.hex()}: {problem.message}")
        finally:
            for item in todo:
                self._leave(item.entry.slot)
        loaded = sum(errors[item.at] is None for item in todo)
        if loaded:
            with self._lock:
                self._counts["loads"] += loaded
        return errors

    def batch_keys(self, block_bytes: int) -> int:
        """Keys per I/O task (`JobRunner`): `run_bytes` worth. Slots taken in one
        round are adjacent, so a run of a job's keys usually lies in one extent of
        one slab and moves in one request (`workers.disk.runs`): a lock round, a
        syscall and a task per run, not per block; the kernel still splits the
        request into as many device requests as the queue takes."""
        if self._io is None or block_bytes != self.block_bytes:
            return 1  # never raises: the runner asks while queueing a job
        return self._io.run_slots

    def exists(self, key: OffloadKey) -> bool:
        with self._lock:
            return key in self._index

    def delete(self, key: OffloadKey) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
        if entry is not None:
            self._retire(entry.slot)

    def inventory(self) -> list[OffloadKey]:
        with self._lock:
            return list(self._index)

    def capacity(self) -> int | None:
        """What the tier can hold now: its budget, or what of it fits on the
        filesystem (it grows as space frees, and shrinks if the disk fills)."""
        self._require()
        return self._usable * self.block_bytes

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self._index.touch(keys)

    def take_evicted(self) -> list[OffloadKey]:
        return self._index.take_evicted()

    def stats(self) -> dict[str, Any]:
        slabs = self._require()
        with self._lock:
            blocks = len(self._index)
            counts = dict(self._counts)
        return {
            "blocks": blocks, "bytes_used": blocks * self.block_bytes,
            "capacity_blocks": self._usable, "capacity_bytes": self.capacity(),
            "usable_blocks": self._usable, "budget_blocks": slabs.total_slots,
            "slot_bytes": self.slot_bytes, "o_direct": self.direct,
            "durable_writes": self.commit.writes, "fdatasyncs": self.commit.syncs,
            **counts,
        }

    def close(self) -> None:
        if self._slabs is not None:
            self._slabs.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1

    # -- metadata (called holding self._lock) ----------------------------------------

    def _take_slot(self, key: OffloadKey, pinned: Container[OffloadKey]) -> int:
        """A free slot: from the free list, else a never used one (the slab files
        grow), else the least recently used block's (not pinned, not being read)."""
        if self._free:
            return self._free.pop()
        if self._fresh < self._usable:
            self._fresh += 1
            return self._fresh - 1
        for victim, entry in self._index.items():
            # A key's own older copy may go: its new copy is on the way.
            if (victim not in pinned or victim == key) and entry.slot not in self._readers:
                self._index.evict(victim)
                self._counts["evictions"] += 1
                return entry.slot
        raise TierError(ErrorCode.NO_SPACE, f"disk tier full: all {self._usable} slots "
                                            f"hold pinned blocks or blocks being read")

    def _install(self, key: OffloadKey, entry: Entry) -> int | None:
        """Point `key` at its new copy; returns the slot that is no longer needed."""
        current = self._index.get(key)
        if current is not None and current.seq > entry.seq:
            return entry.slot  # a later store of the same key finished first
        self._index.put(key, entry)  # present again: no longer reported as evicted
        return current.slot if current is not None else None

    def _stop_growing(self, slab: int, backed: int) -> None:
        """The disk is full: live within the space the slabs have, so later stores
        evict instead of failing on the same slab again (until space frees:
        `_grow_when_full`)."""
        with self._lock:
            limit = slab * self._require().slots_per_slab + backed
            self._grow_after = time.monotonic() + self.grow_retry_s
            if limit >= self._usable:
                return
            log.warning("disk full: the disk tier keeps %d slots of its budget's %d "
                        "(it grows again as space frees)", limit, self._require().total_slots)
            self._usable = limit
            self._fresh = min(self._fresh, limit)
            self._free = [s for s in self._free if s < limit]

    def _grow_when_full(self) -> None:
        """A tier short of its budget, with no slot left but an eviction, asks the
        filesystem for room again (at most every `grow_retry_s`): space that frees
        becomes capacity without a restart. The space itself is taken when a store
        is written there (`_give_space`)."""
        with self._lock:
            slabs = self._require()
            if (self._free or self._fresh < self._usable or self._usable >= slabs.total_slots
                    or time.monotonic() < self._grow_after):
                return
            self._grow_after = time.monotonic() + self.grow_retry_s
        fits = self._fitting()  # a statvfs: not under the lock
        with self._lock:
            if fits <= self._usable:
                return
            self._usable = fits
        log.info("disk tier %s: space freed, capacity now %d of the budget's %d slots",
                 self.directory, fits, slabs.total_slots)

    def _give_space(self, run: list[Item]) -> None:
        """The run's slab has the space of its slots before a block is written
        there (raises SlabGrowthFailed when the disk has none)."""
        slabs = self._require()
        n, _ = slabs.locate(run[-1].entry.slot)
        slabs.ensure(n, run[-1].entry.slot - n * slabs.slots_per_slab + 1)

    def _counted(self, error: TierError) -> TierError:
        if error.code is ErrorCode.NO_SPACE:
            with self._lock:
                self._counts["enospc_failures"] += 1
        return error

    # -- slot lifecycle --------------------------------------------------------------

    def _retire(self, slot: int) -> None:
        """Free a slot whose block is no longer wanted, once nobody reads it."""
        with self._lock:
            if self._readers.get(slot):
                self._retired.add(slot)
                return
        self._release(slot)

    def _leave(self, slot: int) -> None:
        with self._lock:
            left = self._readers[slot] - 1
            if left:
                self._readers[slot] = left
                return
            del self._readers[slot]
            if slot not in self._retired:
                return
            self._retired.remove(slot)
        self._release(slot)

    def _condemn(self, key: OffloadKey, entry: Entry) -> None:
        """A block failed verification: it leaves the index (counted) and its slot
        is freed when the reader (us) leaves. It may already have been replaced."""
        with self._lock:
            self._counts["corrupt_blocks"] += 1
            if self._index.get(key) == entry:
                del self._index[key]
                self._retired.add(entry.slot)

    def _release(self, slot: int) -> None:
        """Zero the slot's header (so a restart cannot revive its block), then free
        it. Best effort: a header that survives is a valid block or fails to verify."""
        slabs = self._require()
        n, offset = slabs.locate(slot)
        # Only where the slab has its space: a write past it would grow the file.
        if offset < slabs.backed(n) * slabs.slot_bytes and slabs.path(n).exists():
            try:
                os.pwrite(slabs.get(n).fd, ZERO_HEADER, offset)
            except (OSError, TierError) as e:
                log.debug("could not clear the header of slot %d: %s", slot, e)
        with self._lock:
            if slot < self._usable:
                self._free.append(slot)

    # -- I/O (never holding self._lock) ----------------------------------------------

    def _direct_ok(self, buf: memoryview) -> bool:
        """Whether `buf` moves with O_DIRECT: any buffer through the staging
        buffer, else only a page-aligned one."""
        if not self.direct:
            return False
        return self.staging or buffer_address(buf) % PAGE == 0

    def _run_io(self) -> RunIO:
        if self._io is None:
            raise TierError(ErrorCode.FATAL, "disk tier is not open")
        return self._io

    def _size_error(self, buf: memoryview, what: str) -> TierError:
        return TierError(ErrorCode.BAD_REQUEST, f"disk tier {what}: {len(buf)} bytes given, "
                                                f"blocks are {self.block_bytes}")

    def _require(self) -> SlabFiles:
        if self._slabs is None:
            raise TierError(ErrorCode.FATAL, "disk tier is not open")
        return self._slabs

