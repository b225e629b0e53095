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
offset, so `O_DIRECT` can move it straight between the file and the 4 KiB-aligned
shared-memory row.

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
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.core.blockformat import (
    HEADER_SIZE,
    MAX_KEY,
    CorruptBlock,
    pack_header,
    unpack_header,
    verify,
)
from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.keys import OffloadKey
from tierkv.tiers.backend import TierBackend
from tierkv.tiers.lru import LRUIndex
from tierkv.tiers.registry import TierConfigError
from workers.disk.commit import GroupCommit
from workers.disk.layout import (
    HEADER_AREA,
    LAYOUT_VERSION,
    PAGE,
    SCAN_PROGRESS_SLOTS,
    ZERO_HEADER,
    ZERO_PAGE_TAIL,
    buffer_address,
    check_root,
    io_error,
    namespace_dir,
    namespace_tag,
    slot_bytes_for,
)
from workers.disk.options import DEFAULT_SLAB_BYTES, OPTIONS
from workers.disk.slabs import SlabFiles, SlabGrowthFailed, fsync_dir, probe_o_direct

log = logging.getLogger("tierkv.disk")

@dataclass(frozen=True, slots=True)
class _Entry:
    slot: int
    seq: int


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
    ) -> None:
        """`root` must exist (a missing or unwritable root fails here, clearly).
        `budget_bytes` fixes the number of slots; `slab_bytes` how many share a file.
        `durable=False` skips fdatasync (benchmarks; a crash may then lose blocks the
        broker was told are stored). `o_direct`: "auto" uses it where the filesystem
        and block size allow, True insists, False never. `group_commit=False` makes
        each store call fdatasync on its own (for comparison). `sync_per="job"` (the
        default) makes a whole store job durable with one flush per slab file, when
        the tier process reports it (`sync`); "store" flushes inside every `store`."""
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
        if type(slab_bytes) is not int or slab_bytes <= 0:
            raise TierConfigError(f"disk tier: slab_bytes must be positive, got {slab_bytes!r}")
        self.namespace = namespace
        self._ns = namespace_tag(namespace)
        self.directory = check_root(Path(root)) / namespace_dir(namespace)
        self._lock_fd = -1
        self._slabs: SlabFiles | None = None
        self._lock = threading.Lock()
        self._index: LRUIndex[_Entry] = LRUIndex(self._lock)
        self._free: list[int] = []
        self._fresh = 0  # slots from here on were never handed out (their slab may not exist)
        self._usable = 0  # slots below this may be used: the budget, less what the disk refused
        self._readers: dict[int, int] = {}
        self._retired: set[int] = set()  # freed while read: released by the last reader
        self._seq = 0
        self._tls = threading.local()
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
        slots_per_slab = self._check_meta(max(1, slab_bytes // self.slot_bytes))
        self.direct = self._choose_direct(o_direct)
        total = budget_bytes // self.slot_bytes
        self._slabs = SlabFiles(self.directory, self.slot_bytes, slots_per_slab, total,
                                self.direct)
        self._slabs.fit_to_budget()

    def _check_meta(self, slots_per_slab: int) -> int:
        """The geometry of the blocks already here must be this node's; returns the
        slots per slab to use (the one on disk wins: it fixes where slots are)."""
        path = self.directory / "meta.json"
        want = {"layout_version": LAYOUT_VERSION, "block_bytes": self.block_bytes,
                "slot_bytes": self.slot_bytes, "slots_per_slab": slots_per_slab,
                "namespace": self.namespace}
        if path.exists():
            try:
                have = json.loads(path.read_text())
                same = all(have[k] == want[k] for k in
                           ("layout_version", "block_bytes", "slot_bytes", "namespace"))
                on_disk = int(have["slots_per_slab"])
            except (ValueError, KeyError, TypeError) as e:
                raise TierError(ErrorCode.FATAL, f"{path} is unreadable ({e}); "
                                                 f"remove {self.directory} to start empty") from e
            if not same:
                raise TierError(ErrorCode.FATAL, (
                    f"{self.directory} holds {have.get('block_bytes')}-byte blocks "
                    f"(layout {have.get('layout_version')}), this node's are "
                    f"{self.block_bytes} bytes: use another namespace or remove the directory"))
            if on_disk != slots_per_slab:
                log.info("keeping %d slots per slab as found in %s", on_disk, path)
            return on_disk
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(want, indent=1))
        os.replace(tmp, path)
        fsync_dir(self.directory)
        return slots_per_slab

    def _choose_direct(self, o_direct: str | bool) -> bool:
        if o_direct is False:
            return False
        why = probe_o_direct(self.directory)
        if why is None and self.block_bytes % PAGE:
            why = f"blocks of {self.block_bytes} bytes are not a multiple of {PAGE}"
        if why is None:
            return True
        if o_direct is True:
            raise TierError(ErrorCode.FATAL, f"o_direct = true but O_DIRECT cannot be used in "
                                             f"{self.directory}: {why}")
        log.warning("disk tier %s: buffered I/O, no O_DIRECT (%s)", self.directory, why)
        return False

    def _scan(self) -> None:
        """Rebuild the index from slot headers: only 256 bytes per slot are read."""
        slabs = self._require()
        t0 = time.monotonic()
        found: dict[OffloadKey, _Entry] = {}
        stale: list[int] = []
        on_disk = set(slabs.on_disk())
        top = max(on_disk) + 1 if on_disk else 0
        total = sum(slabs.slots_in(n) for n in on_disk)
        scanned = 0
        for n in range(top):
            first = n * slabs.slots_per_slab
            if n not in on_disk:
                self._free.extend(range(first, first + slabs.slots_in(n)))
                continue
            fd = slabs.get(n).fd
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead of payloads
            for i in range(slabs.slots_in(n)):
                read = self._read_slot_header(fd, first + i, i * slabs.slot_bytes)
                if read is None:
                    self._free.append(first + i)
                else:
                    key, new = read
                    old = found.get(key)
                    if old is not None:  # two valid copies: the later write wins
                        new, loser = (new, old) if new.seq > old.seq else (old, new)
                        stale.append(loser.slot)
                    found[key] = new
                scanned += 1
                if scanned % SCAN_PROGRESS_SLOTS == 0:
                    log.info("disk tier scan: %d/%d slots, %d blocks", scanned, total, len(found))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
        for key, kept in sorted(found.items(), key=lambda item: item[1].seq):
            self._index[key] = kept
        self._seq = max((e.seq for e in found.values()), default=0)
        self._fresh = min(top * slabs.slots_per_slab, slabs.total_slots)
        self._usable = slabs.total_slots
        self._free.reverse()  # pop() hands out low slots first
        for slot in stale:
            self._release(slot)
        log.info("disk tier %s: %d blocks in %d slots (%d free, capacity %d) in %.2fs",
                 self.directory, len(self._index), scanned, len(self._free),
                 slabs.total_slots, time.monotonic() - t0)

    def _read_slot_header(self, fd: int, slot: int, offset: int) -> tuple[bytes, _Entry] | None:
        raw = os.pread(fd, HEADER_SIZE, offset)
        if raw == ZERO_HEADER:
            return None
        try:
            header = unpack_header(raw)
        except CorruptBlock:
            self._counts["invalid_slots_at_start"] += 1
            return None
        if header.namespace != self._ns or header.payload_len != self.block_bytes:
            self._counts["invalid_slots_at_start"] += 1
            return None
        return header.key, _Entry(slot, header.seq)

    # -- TierBackend -----------------------------------------------------------------

    def store(self, key: OffloadKey, src: memoryview, pinned: Container[OffloadKey] = ()) -> None:
        self._check_size(src, "store")
        if not 0 < len(key) <= MAX_KEY:
            raise TierError(ErrorCode.BAD_REQUEST, f"keys are 1..{MAX_KEY} bytes, got {len(key)}")
        with self._lock:
            slot = self._take_slot(key, pinned)
            self._seq += 1
            entry = _Entry(slot, self._seq)
        try:
            fd = self._write(key, entry, src)
            if self.sync_per == "store":
                self.commit.commit(fd)
            else:
                with self._lock:
                    self._written.add(fd)
        except OSError as e:
            self._release(slot)
            raise self._counted(io_error(e, f"store of {key.hex()} failed")) from e
        except TierError as e:
            if isinstance(e, SlabGrowthFailed) and e.code is ErrorCode.NO_SPACE:
                self._stop_growing(e.slab)
            self._release(slot)
            raise self._counted(e)  # noqa: B904 - already translated, cause kept
        except BaseException:
            self._release(slot)
            raise
        with self._lock:
            self._counts["stores"] += 1
            replaced = self._install(key, entry)
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
        self._check_size(dst, "load")
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                raise TierError(ErrorCode.NOT_FOUND, f"key {key.hex()} is not in the disk tier")
            self._index.move_to_end(key)
            self._readers[entry.slot] = self._readers.get(entry.slot, 0) + 1
        try:
            self._read_verified(key, entry, dst)
        except CorruptBlock as e:
            self._condemn(key, entry)
            log.warning("disk tier: corrupt block of key %s in slot %d: %s", key.hex(),
                        entry.slot, e.message)
            raise CorruptBlock(f"key {key.hex()}: {e.message}") from None
        except OSError as e:
            raise io_error(e, f"load of {key.hex()} failed") from e
        finally:
            self._leave(entry.slot)
        with self._lock:
            self._counts["loads"] += 1

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
        return self._require().total_slots * self.block_bytes

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
            "capacity_blocks": slabs.total_slots, "capacity_bytes": self.capacity(),
            "usable_blocks": self._usable,
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

    def _install(self, key: OffloadKey, entry: _Entry) -> int | None:
        """Point `key` at its new copy; returns the slot that is no longer needed."""
        current = self._index.get(key)
        if current is not None and current.seq > entry.seq:
            return entry.slot  # a later store of the same key finished first
        self._index.put(key, entry)  # present again: no longer reported as evicted
        return current.slot if current is not None else None

    def _stop_growing(self, slab: int) -> None:
        """The disk is full: live within the slabs there are, so later stores evict
        instead of failing on the same slab again (until the next start)."""
        with self._lock:
            limit = slab * self._require().slots_per_slab
            if limit >= self._usable:
                return
            log.warning("disk full: the disk tier keeps %d slots of its budget's %d", limit,
                        self._require().total_slots)
            self._usable = limit
            self._fresh = min(self._fresh, limit)
            self._free = [s for s in self._free if s < limit]

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

    def _condemn(self, key: OffloadKey, entry: _Entry) -> None:
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
        if slabs.path(n).exists():
            try:
                os.pwrite(slabs.get(n).fd, ZERO_HEADER, offset)
            except (OSError, TierError) as e:
                log.debug("could not clear the header of slot %d: %s", slot, e)
        with self._lock:
            if slot < self._usable:
                self._free.append(slot)

    # -- I/O (never holding self._lock) ----------------------------------------------

    def _write(self, key: OffloadKey, entry: _Entry, src: memoryview) -> int:
        """One `pwritev` of header and payload, straight from the caller's buffer.
        Returns the buffered descriptor, which fdatasync uses."""
        slabs = self._require()
        n, offset = slabs.locate(entry.slot)
        slab = slabs.get(n)
        header = self._header_buffer()
        header[:HEADER_SIZE] = pack_header(key, self._ns, src, entry.seq)
        header[HEADER_SIZE:] = ZERO_PAGE_TAIL
        fd = slab.dfd if self._direct_ok(src) else slab.fd
        done = os.pwritev(fd, [header, src], offset)
        if done != HEADER_AREA + len(src):  # a short write: finish it plainly
            rest = (bytes(header) + bytes(src))[done:]
            while rest:
                wrote = os.pwrite(slab.fd, rest, offset + HEADER_AREA + len(src) - len(rest))
                rest = rest[wrote:]
        return slab.fd

    def _read_verified(self, key: OffloadKey, entry: _Entry, dst: memoryview) -> None:
        """Header and payload in one `preadv` straight into `dst`, then verified.
        On failure `dst` holds garbage, but the job fails, so no one takes it as data."""
        slabs = self._require()
        n, offset = slabs.locate(entry.slot)
        slab = slabs.get(n)
        header = self._header_buffer()
        fd = slab.dfd if self._direct_ok(dst) else slab.fd
        got = os.preadv(fd, [header, dst], offset)
        if got < HEADER_AREA + len(dst):
            raise CorruptBlock(f"slot {entry.slot} is truncated ({got} bytes)")
        parsed = unpack_header(header[:HEADER_SIZE])
        verify(parsed, key, self._ns, dst)
        if parsed.seq != entry.seq:
            raise CorruptBlock(f"slot {entry.slot} holds write {parsed.seq}, not {entry.seq}")

    def _header_buffer(self) -> memoryview:
        """A page-aligned header buffer per thread (anonymous mmap), as O_DIRECT needs."""
        buf = getattr(self._tls, "header", None)
        if buf is None:
            buf = self._tls.header = memoryview(mmap.mmap(-1, HEADER_AREA))
        return buf

    def _direct_ok(self, buf: memoryview) -> bool:
        return self.direct and buffer_address(buf) % PAGE == 0

    def _check_size(self, buf: memoryview, what: str) -> None:
        if len(buf) != self.block_bytes:
            raise TierError(ErrorCode.BAD_REQUEST, f"disk tier {what}: {len(buf)} bytes given, "
                                                   f"blocks are {self.block_bytes}")

    def _require(self) -> SlabFiles:
        if self._slabs is None:
            raise TierError(ErrorCode.FATAL, "disk tier is not open")
        return self._slabs

