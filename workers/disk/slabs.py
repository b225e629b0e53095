"""The disk tier's slab files: preallocated files of fixed-size slots, opened and
grown on demand within the budget."""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tierkv.core.errors import ErrorCode, TierError
from workers.disk.layout import O_DIRECT_FLAG, PAGE, io_error

log = logging.getLogger("tierkv.disk")

# Free space a growing slab leaves to the rest of the filesystem: a little, so that
# the tier never fills it to the last block (1/64 of its size, at most 256 MiB).
HEADROOM_FRACTION = 64
HEADROOM_MAX = 256 << 20


class SlabGrowthFailed(TierError):
    """Slab `slab` could not be created or grown (a full disk, usually); its first
    `backed` slots still have their space."""

    def __init__(self, code: ErrorCode, message: str, slab: int, backed: int = 0) -> None:
        super().__init__(code, message)
        self.slab = slab
        self.backed = backed


@dataclass(frozen=True, slots=True)
class _Slab:
    fd: int  # buffered
    dfd: int  # O_DIRECT, -1 when not used


class SlabFiles:
    """The slab files of one namespace directory, opened (and grown) on first use.

    Slot `s` lives in slab `s // slots_per_slab` at offset
    `(s % slots_per_slab) * slot_bytes`. A slab's space is preallocated before a
    block is written into it, so a full disk shows up there (ENOSPC, or too little
    free space) and not in the middle of a block. A slab grows to its full size
    when the filesystem has the room, else to what fits, less a little headroom:
    a budget larger than the free space holds what fits, and the short slab grows
    again when space frees. Only the last slab of the budget is shorter by
    geometry, so the files never pass the budget.
    """

    def __init__(self, directory: Path, slot_bytes: int, slots_per_slab: int,
                 total_slots: int, direct: bool) -> None:
        self.directory = directory
        self.slot_bytes = slot_bytes
        self.slots_per_slab = slots_per_slab
        self.total_slots = total_slots
        self.direct = direct
        self.count = -(-total_slots // slots_per_slab)
        self._open: dict[int, _Slab] = {}
        self._backed: dict[int, int] = {}  # slab -> its first slots that have their space
        self._grow_lock = threading.Lock()
        self.closed = False

    def locate(self, slot: int) -> tuple[int, int]:
        n, i = divmod(slot, self.slots_per_slab)
        return n, i * self.slot_bytes

    def slots_in(self, n: int) -> int:
        return min(self.slots_per_slab, self.total_slots - n * self.slots_per_slab)

    def path(self, n: int) -> Path:
        return self.directory / f"slab-{n:05d}.dat"

    def on_disk(self) -> list[int]:
        found = []
        for p in self.directory.glob("slab-*.dat"):
            stem = p.stem.removeprefix("slab-")
            if stem.isdigit():
                found.append(int(stem))
        return sorted(found)

    def fit_to_budget(self) -> None:
        """Drop slabs (and slab tails) beyond the budget, which may have shrunk;
        note how many slots of each slab left have their space."""
        for n in self.on_disk():
            path, want = self.path(n), self.slots_in(n) * self.slot_bytes
            if n >= self.count:
                log.warning("budget shrank: removing %s", path)
                path.unlink()
                continue
            size = path.stat().st_size
            if size > want:
                log.warning("budget shrank: truncating %s to %d bytes", path, want)
                os.truncate(path, want)
            self._backed[n] = min(size, want) // self.slot_bytes

    def backed(self, n: int) -> int:
        """Slots at the start of slab `n` whose space is allocated."""
        return self._backed.get(n, 0)

    def backed_end(self) -> int:
        """The slot after the last one with space: where growing goes on."""
        if not self._backed:
            return 0
        top = max(self._backed)
        return top * self.slots_per_slab + self._backed[top]

    def room_slots(self) -> int | None:
        """Slots the filesystem has room for now, beyond what the slabs hold,
        keeping the headroom; None where it reports no size (then only a try
        tells)."""
        try:
            st = os.statvfs(self.directory)
        except OSError as e:
            log.warning("cannot ask %s for its free space: %s", self.directory, e)
            return None
        if st.f_blocks == 0:
            return None
        headroom = min(HEADROOM_MAX, st.f_blocks * st.f_frsize // HEADROOM_FRACTION)
        return max(0, st.f_bavail * st.f_frsize - headroom) // self.slot_bytes

    def get(self, n: int) -> _Slab:
        slab = self._open.get(n)
        if slab is not None:
            return slab
        with self._grow_lock:  # growth is rare; metadata lookups never wait on it
            return self._get_locked(n)

    def _get_locked(self, n: int) -> _Slab:
        if self.closed:
            raise TierError(ErrorCode.FATAL, "the disk tier is closed")
        slab = self._open.get(n)
        if slab is None:
            slab = self._open[n] = self._open_slab(n)
        return slab

    def ensure(self, n: int, upto: int) -> None:
        """Slab `n` has the space of its first `upto` slots (created or grown to
        its full size, or to what fits if that is less); raises SlabGrowthFailed
        (NO_SPACE when the disk is full) and leaves the slab as it was."""
        if self._backed.get(n, 0) >= upto:
            return  # the usual case: no lock, no system call
        with self._grow_lock:
            have = self._backed.get(n, 0)
            if have >= upto:
                return
            created = not self.path(n).exists()
            slab = self._get_locked(n)
            target = self._grow_target(n, have)
            if target < upto:
                self._undo(n, slab, created, None)
                raise SlabGrowthFailed(ErrorCode.NO_SPACE, (
                    f"no space to grow disk tier slab {self.path(n)}: the filesystem has "
                    f"room for {target - have} more slots, less a little headroom"), n, have)
            size = os.fstat(slab.fd).st_size
            try:
                if size < target * self.slot_bytes:
                    os.posix_fallocate(slab.fd, size, target * self.slot_bytes - size)
            except OSError as e:
                self._undo(n, slab, created, size)
                error = io_error(e, f"cannot grow disk tier slab {self.path(n)} to "
                                    f"{target * self.slot_bytes} bytes")
                raise SlabGrowthFailed(error.code, error.message, n, have) from e
            self._backed[n] = target

    def _grow_target(self, n: int, have: int) -> int:
        """The slots slab `n` grows to: all of them, or what the filesystem fits."""
        full = self.slots_in(n)
        room = self.room_slots()
        return full if room is None else min(full, have + room)

    def _undo(self, n: int, slab: _Slab, created: bool, size: int | None) -> None:
        """A growth that failed leaves no trace: a new slab file goes, an old one
        gets its size back (a failed fallocate may have kept part of its space)."""
        try:
            if created:
                self._close_slab(n, slab)
                self.path(n).unlink(missing_ok=True)
            elif size is not None:
                os.ftruncate(slab.fd, size)
        except OSError as e:
            log.debug("could not undo the growth of %s: %s", self.path(n), e)

    def _open_slab(self, n: int) -> _Slab:
        """Opens slab `n`, creating an empty one; `ensure` gives it its space."""
        path = self.path(n)
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if created:
                fsync_dir(self.directory)
            dfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | O_DIRECT_FLAG) if self.direct else -1
        except OSError as e:
            os.close(fd)
            if created:
                path.unlink(missing_ok=True)
            error = io_error(e, f"cannot open disk tier slab {path}")
            raise SlabGrowthFailed(error.code, error.message, n) from e
        return _Slab(fd, dfd)

    def _close_slab(self, n: int, slab: _Slab) -> None:
        self._open.pop(n, None)
        self._backed.pop(n, None)
        os.close(slab.fd)
        if slab.dfd >= 0:
            os.close(slab.dfd)

    def close(self) -> None:
        with self._grow_lock:
            self.closed = True
            for n, slab in list(self._open.items()):
                self._close_slab(n, slab)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def probe_o_direct(directory: Path) -> str | None:
    """None if O_DIRECT works in `directory`, else why not."""
    if not O_DIRECT_FLAG:
        return "this platform has no O_DIRECT"
    path = directory / ".o_direct-probe"
    buf = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | O_DIRECT_FLAG, 0o600)
        try:
            os.pwrite(fd, buf, 0)
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        path.unlink(missing_ok=True)
        buf.close()
    return None

