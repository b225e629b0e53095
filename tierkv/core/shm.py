"""The CPU tier's memory: one POSIX shared-memory region shared by every process.

Ownership lives here and nowhere else: the broker creates the region (exclusively,
mode 0600) and alone unlinks it; gpu workers and tier processes attach and validate
the header. Block bytes move through this region, never over ZeroMQ.

Layout::

    [ header page, 4 KiB ][ row 0 ][ row 1 ] ... [ row num_blocks-1 ]
    row  = world_size pages of page_size bytes, padded to a 4 KiB multiple
    page = the bytes of one block of one tensor-parallel rank (all layers, K and V)
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import posix_ipc

from tierkv.core.units import format_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tierkv.core.shm")

MAGIC = b"TIERKVR\x00"
LAYOUT_VERSION = 1
ALIGN = 4096
HEADER_SIZE = ALIGN
MAX_INSTANCE_LEN = 64
# magic, version, num_blocks, page_size, world_size, row_stride, data_offset,
# owner pid, owner start time (clock ticks; tells a live owner from a reused pid),
# instance name.
_HEADER = struct.Struct("<8sIQQIQQIQ64s")


class RegionError(RuntimeError):
    """The region cannot be created or attached; the message says why."""


class RegionInUseError(RegionError):
    """A live process already owns a region of this instance name."""


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def region_name(instance: str) -> str:
    return f"/tierkv.{instance}.cpu"


def _check_instance(instance: str) -> None:
    if not instance or len(instance.encode()) > MAX_INSTANCE_LEN:
        raise RegionError(f"instance name must be 1..{MAX_INSTANCE_LEN} bytes, got {instance!r}")
    if "/" in instance or "\x00" in instance:
        raise RegionError(f"instance name may not contain '/' or NUL: {instance!r}")


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return 0
    # Field 22; the command name (field 2) may contain spaces, so split after ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])


def owner_alive(pid: int, start_time: int) -> bool:
    started = process_start_time(pid)
    if started is None:
        return False
    # A start time of 0 means "could not read it": trust the pid alone.
    return start_time == 0 or started == 0 or started == start_time


@dataclass(frozen=True)
class RegionLayout:
    num_blocks: int
    page_size: int
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_blocks", "page_size", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise RegionError(f"{name} must be a positive integer, got {value!r}")

    @property
    def row_stride(self) -> int:
        return align_up(self.page_size * self.world_size)

    @property
    def data_offset(self) -> int:
        return HEADER_SIZE

    @property
    def total_size(self) -> int:
        return HEADER_SIZE + self.row_stride * self.num_blocks


class SharedRegion:
    """A mapped CPU-tier region. Use `create` (owner) or `attach` (everyone else)."""

    def __init__(
        self, instance: str, layout: RegionLayout, mm: mmap.mmap, owner: bool
    ) -> None:
        self.instance = instance
        self.name = region_name(instance)
        self.layout = layout
        self.is_owner = owner
        self._mmap: mmap.mmap | None = mm
        self._data: memoryview | None = memoryview(mm)[
            layout.data_offset : layout.data_offset + layout.row_stride * layout.num_blocks
        ]
        self._unlinked = False

    # -- construction ---------------------------------------------------------------

    @classmethod
    def create(
        cls, instance: str, num_blocks: int, page_size: int, world_size: int = 1,
        prefault: bool = False,
    ) -> SharedRegion:
        """Create the region exclusively. A stale region of a dead owner is replaced;
        a live owner's region raises `RegionInUseError`. `prefault` touches every page
        now, so the first stores do not pay for allocating it (measured: a fresh
        node's first store ran at a tenth of the speed of the next ones)."""
        _check_instance(instance)
        layout = RegionLayout(num_blocks, page_size, world_size)
        name = region_name(instance)
        # A dead owner's region (a broker killed before it could unlink) still holds
        # its pages: unlink it before counting what is free, or the restart of a CPU
        # tier larger than half of /dev/shm never fits in the room it fitted in before.
        # (Its pages return once the last process that maps it lets go.)
        remove_stale_region(instance)
        if _region_exists(name):
            raise _in_use(instance, name)
        _check_free_shm(layout.total_size)
        try:
            shm = posix_ipc.SharedMemory(
                name, posix_ipc.O_CREX, mode=0o600, size=layout.total_size
            )
        except posix_ipc.ExistentialError as e:  # another creator won the race
            raise _in_use(instance, name) from e
        try:
            mm = mmap.mmap(shm.fd, layout.total_size)
        finally:
            shm.close_fd()
        pid = os.getpid()
        mm[: _HEADER.size] = _HEADER.pack(
            MAGIC,
            LAYOUT_VERSION,
            layout.num_blocks,
            layout.page_size,
            layout.world_size,
            layout.row_stride,
            layout.data_offset,
            pid,
            process_start_time(pid) or 0,
            instance.encode(),
        )
        if prefault:
            allocate_pages(mm)
        log.info(
            "created %s: %d blocks x %d B x %d ranks (%.1f MiB)",
            name, num_blocks, page_size, world_size, layout.total_size / 2**20,
        )
        return cls(instance, layout, mm, owner=True)

    @classmethod
    def attach(cls, instance: str, expect: RegionLayout | None = None,
               populate: bool = False) -> SharedRegion:
        """Map an existing region and validate its header (against `expect` if given).
        `populate`: for a process that copies blocks through it (`map_resident`)."""
        _check_instance(instance)
        name = region_name(instance)
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as e:
            raise RegionError(
                f"shared memory {name} does not exist: is the broker of instance "
                f"{instance!r} running?"
            ) from e
        try:
            if shm.size < HEADER_SIZE:
                raise RegionError(f"{name}: {shm.size} bytes is too small for a tierkv header")
            mm = mmap.mmap(shm.fd, shm.size)
            started = time.monotonic()
            if populate and map_resident(mm, shm.fd):
                log.info("mapped %s: %.1f GiB in %.2f s", name, shm.size / 2**30,
                         time.monotonic() - started)
        finally:
            shm.close_fd()
        try:
            header = _read_header(mm, name)
            layout = RegionLayout(header["num_blocks"], header["page_size"], header["world_size"])
            _validate(header, layout, instance, name, mm.size(), expect)
        except Exception:
            mm.close()
            raise
        return cls(instance, layout, mm, owner=False)

    @property
    def generation(self) -> str:
        """Which creation of the instance's region this is ("owner pid.start time"): a
        broker restarted on the same instance makes a new region under the same name,
        and block ids the old one handed out name nothing in the new."""
        if self._mmap is None:
            raise RegionError(f"{self.name} is closed")
        header = _read_header(self._mmap, self.name)
        return f"{header['owner_pid']}.{header['owner_start']}"

    @property
    def owner_alive(self) -> bool:
        """Is the process that created this region still running? Only meaningful in
        its pid namespace (a process of another container may not see it)."""
        if self._mmap is None:
            raise RegionError(f"{self.name} is closed")
        header = _read_header(self._mmap, self.name)
        return owner_alive(header["owner_pid"], header["owner_start"])

    # -- views (zero copy) ---------------------------------------------------------

    @property
    def data(self) -> memoryview:
        """The whole data area: num_blocks rows of row_stride bytes."""
        if self._data is None:
            raise RegionError(f"{self.name} is closed")
        return self._data

    def row(self, block_id: int) -> memoryview:
        start = self._row_offset(block_id)
        return self.data[start : start + self.layout.row_stride]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all ranks: what a secondary tier stores."""
        return self.layout.page_size * self.layout.world_size

    def block(self, block_id: int) -> memoryview:
        """Every rank's page of one row, without the row's alignment padding."""
        start = self._row_offset(block_id)
        return self.data[start : start + self.block_bytes]

    def page(self, block_id: int, rank: int = 0) -> memoryview:
        if not 0 <= rank < self.layout.world_size:
            raise IndexError(f"rank {rank} out of range [0, {self.layout.world_size})")
        start = self._row_offset(block_id) + rank * self.layout.page_size
        return self.data[start : start + self.layout.page_size]

    def numpy(self) -> np.ndarray:
        """uint8 array of shape (num_blocks, row_stride)."""
        return np.frombuffer(self.data, dtype=np.uint8).reshape(
            self.layout.num_blocks, self.layout.row_stride
        )

    def numpy_row(self, block_id: int) -> np.ndarray:
        return np.frombuffer(self.row(block_id), dtype=np.uint8)

    def numpy_page(self, block_id: int, rank: int = 0) -> np.ndarray:
        return np.frombuffer(self.page(block_id, rank), dtype=np.uint8)

    def numpy_pages(self, rank: int = 0) -> np.ndarray:
        """uint8 array (num_blocks, page_size): rank `rank`'s page of every row."""
        start = rank * self.layout.page_size
        return self.numpy()[:, start : start + self.layout.page_size]

    def torch_view(self) -> torch.Tensor:
        """uint8 CPU tensor of shape (num_blocks, row_stride), sharing the map."""
        import torch

        return torch.from_numpy(self.numpy())

    def torch_row(self, block_id: int) -> torch.Tensor:
        return self.torch_view()[block_id]

    def torch_page(self, block_id: int, rank: int = 0) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.numpy_page(block_id, rank))

    def _row_offset(self, block_id: int) -> int:
        if not 0 <= block_id < self.layout.num_blocks:
            raise IndexError(f"block {block_id} out of range [0, {self.layout.num_blocks})")
        return block_id * self.layout.row_stride

    # -- lifetime -----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unmap. Idempotent. Views handed out must be dropped first; if some are
        still alive the map is left to the garbage collector rather than raising."""
        if self._data is not None:
            self._data.release()
            self._data = None
        if self._mmap is not None:
            mm, self._mmap = self._mmap, None
            try:
                mm.close()
            except BufferError:
                log.warning(
                    "%s: views still alive at close; unmapped when they are freed", self.name
                )

    def unlink(self) -> None:
        """Remove the name (owner only). Idempotent; mappings stay valid until closed."""
        if not self.is_owner:
            raise RegionError(f"only the creator of {self.name} may unlink it")
        if self._unlinked:
            return
        self._unlinked = True
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
        if self.is_owner:
            self.unlink()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "attached"
        return f"SharedRegion({self.name}, {self.layout}, {role})"


# Linux >= 5.14: allocate the pages without changing their contents. Python 3.11's
# mmap module knows the call but not this constant.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def allocate_pages(mm: mmap.mmap) -> None:
    """Allocate a new segment's pages now, not at the first copy into each."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: write one byte per page back as it is
        data = np.frombuffer(mm, dtype=np.uint8)
        data[::ALIGN] = data[::ALIGN].copy()  # (the same view, numpy would skip it)


# Linux >= 5.14: map pages that exist into this process without writing them.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def map_resident(mm: mmap.mmap, fd: int) -> bool:
    """Map every page of a shared segment into this process now, if its creator
    allocated them all (a prefaulted region, an engine's KV cache); True if it did.

    A process that maps a segment another one filled still takes a page fault at
    its first touch of each 4 KiB page: ~1.8 us each here, so a worker's first copy
    through 256 MiB ran at 0.5 GB/s against 4-5 GB/s for every later one. One call
    maps them all at ~0.09 s per GiB. A segment not fully allocated is left alone:
    this would allocate it (a shared page is allocated by a read fault too)."""
    if os.fstat(fd).st_blocks * 512 < mm.size():
        return False
    try:
        mm.madvise(MADV_POPULATE_READ)
    except OSError:  # a kernel before 5.14: pages fault in at first touch, as before
        return False
    return True


def _read_header(mm: mmap.mmap, name: str) -> dict[str, Any]:
    fields = _HEADER.unpack_from(mm, 0)
    keys = (
        "magic", "layout_version", "num_blocks", "page_size", "world_size",
        "row_stride", "data_offset", "owner_pid", "owner_start", "instance",
    )
    header = dict(zip(keys, fields, strict=True))
    if header["magic"] != MAGIC:
        raise RegionError(f"{name}: magic is {header['magic']!r}, expected {MAGIC!r}")
    if header["layout_version"] != LAYOUT_VERSION:
        raise RegionError(
            f"{name}: layout_version is {header['layout_version']}, expected {LAYOUT_VERSION}"
        )
    header["instance"] = header["instance"].rstrip(b"\x00").decode(errors="replace")
    return header


def _validate(
    header: dict[str, Any],
    layout: RegionLayout,
    instance: str,
    name: str,
    mapped: int,
    expect: RegionLayout | None,
) -> None:
    def mismatch(field: str, found: Any, wanted: Any) -> RegionError:
        return RegionError(f"{name}: header field {field} is {found!r}, expected {wanted!r}")

    if header["instance"] != instance:
        raise mismatch("instance", header["instance"], instance)
    for field in ("row_stride", "data_offset"):
        if header[field] != getattr(layout, field):
            raise mismatch(field, header[field], getattr(layout, field))
    if expect is not None:
        for field in ("num_blocks", "page_size", "world_size"):
            if getattr(layout, field) != getattr(expect, field):
                raise mismatch(field, getattr(layout, field), getattr(expect, field))
    if mapped < layout.total_size:
        raise mismatch("size", mapped, layout.total_size)


def _region_exists(name: str) -> bool:
    """Whether a segment of this name exists (opened, not created: nothing changes)."""
    try:
        posix_ipc.SharedMemory(name).close_fd()
    except posix_ipc.ExistentialError:
        return False
    return True


def _in_use(instance: str, name: str) -> RegionInUseError:
    return RegionInUseError(
        f"instance {instance!r} already running (shared memory {name} exists)"
    )


def remove_stale_region(instance: str) -> None:
    """Unlink the region of `instance` if its owner is dead; leave a live one alone."""
    name = region_name(instance)
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        return
    try:
        if shm.size < HEADER_SIZE:
            stale = True
        else:
            with mmap.mmap(shm.fd, HEADER_SIZE, prot=mmap.PROT_READ) as mm:
                fields = _HEADER.unpack_from(mm, 0)
            magic, pid, start = fields[0], fields[7], fields[8]
            stale = magic != MAGIC or not owner_alive(pid, start)
    finally:
        shm.close_fd()
    if stale:
        log.warning("removing stale shared memory %s of a dead owner", name)
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass


def sweep_stale_regions(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink every tierkv region whose owner is dead. Returns the names removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.startswith("tierkv.") and entry.endswith(".cpu"):
            instance = entry[len("tierkv.") : -len(".cpu")]
            if not instance:
                continue
            before = os.path.exists(os.path.join(shm_dir, entry))
            try:
                remove_stale_region(instance)
            except (OSError, struct.error, posix_ipc.Error):
                continue
            if before and not os.path.exists(os.path.join(shm_dir, entry)):
                removed.append(entry)
    return removed


def _check_free_shm(size: int, shm_dir: str = "/dev/shm") -> None:
    """Refuse a segment larger than the free space now: tmpfs would SIGBUS at the
    first touch of a page it has no room for, far from the cause."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise RegionError(
            f"region of {format_bytes(size)} does not fit: {shm_dir} has "
            f"{format_bytes(free)} free (lower cpu.num_blocks or page_size)"
        )
