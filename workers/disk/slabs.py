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

class SlabGrowthFailed(TierError):
    """Slab `slab` could not be created or grown (a full disk, usually)."""

    def __init__(self, code: ErrorCode, message: str, slab: int) -> None:
        super().__init__(code, message)
        self.slab = slab


@dataclass(frozen=True, slots=True)
class _Slab:
    fd: int  # buffered
    dfd: int  # O_DIRECT, -1 when not used


class SlabFiles:
    """The slab files of one namespace directory, opened (and grown) on first use.

    Slot `s` lives in slab `s // slots_per_slab` at offset
    `(s % slots_per_slab) * slot_bytes`. A slab is preallocated to its full size
    when created, so a full disk shows up there (ENOSPC) and not in the middle
    of a block; only the last slab is shorter, so the files never pass the budget.
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
        """Drop slabs (and slab tails) beyond the budget, which may have shrunk."""
        for n in self.on_disk():
            path, want = self.path(n), self.slots_in(n) * self.slot_bytes
            if n >= self.count:
                log.warning("budget shrank: removing %s", path)
                path.unlink()
            elif path.stat().st_size > want:
                log.warning("budget shrank: truncating %s to %d bytes", path, want)
                os.truncate(path, want)

    def get(self, n: int) -> _Slab:
        slab = self._open.get(n)
        if slab is not None:
            return slab
        with self._grow_lock:  # growth is rare; metadata lookups never wait on it
            if self.closed:
                raise TierError(ErrorCode.FATAL, "the disk tier is closed")
            slab = self._open.get(n)
            if slab is None:
                slab = self._open[n] = self._open_slab(n)
            return slab

    def _open_slab(self, n: int) -> _Slab:
        path, want = self.path(n), self.slots_in(n) * self.slot_bytes
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size < want:
                os.posix_fallocate(fd, size, want - size)
            if created:
                fsync_dir(self.directory)
            dfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | O_DIRECT_FLAG) if self.direct else -1
        except OSError as e:
            os.close(fd)
            if created:
                path.unlink(missing_ok=True)
            error = io_error(e, f"cannot grow disk tier slab {path} to {want} bytes")
            raise SlabGrowthFailed(error.code, error.message, n) from e
        return _Slab(fd, dfd)

    def close(self) -> None:
        with self._grow_lock:
            self.closed = True
            for slab in self._open.values():
                os.close(slab.fd)
                if slab.dfd >= 0:
                    os.close(slab.dfd)
            self._open.clear()


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

