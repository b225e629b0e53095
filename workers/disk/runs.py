"""Runs of adjacent slots: how the disk tier moves several blocks in one request.

Runs on the tier's I/O threads; every call may block. Slots handed out in one
round of the backend's lock are adjacent, so a run of a job's keys usually lies
in one extent of one slab: one `preadv`/`pwritev` per run instead of one per
block (~40 us of Python per 256 KiB block otherwise: task, lock rounds, syscall).

Why staging buffers: a request to a virtio disk without indirect descriptors
(Firecracker's, for one) takes one ring descriptor per physically contiguous
piece of memory, and the ring holds 256. A shared-memory row is physically 4 KiB
pages, so a few 256 KiB requests fill the ring, whatever their size or number:
measured 1.2-1.4 GB/s of O_DIRECT reads at any request size and queue depth.
The same reads into 2 MiB transparent huge pages are one descriptor per 2 MiB,
and reached 3.5 GB/s (4-8 MiB requests). So an O_DIRECT run moves through a
per-thread huge-page buffer, one iovec for the whole run, and the blocks are
copied to or from the rows (numpy, without the GIL; ~13 GB/s). A load verifies
each block in the staging buffer and copies only the ones that pass, so a bad
block never reaches its row. The copy costs about 8% of a core per GB/s moved;
where the kernel grants no huge page (THP off) it buys nothing, and `staging =
false` in the tier entry moves the rows directly again.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tierkv.core.blockformat import HEADER_SIZE, CorruptBlock, pack_header, unpack_header, verify
from tierkv.tiers.backend import detached
from workers.disk.layout import HEADER_AREA, ZERO_PAGE_TAIL, buffer_address
from workers.disk.slabs import SlabFiles

MAX_RUN = 256  # blocks per request at most: two iovecs each, within IOV_MAX (1024)
HUGE = 2 << 20  # a transparent huge page: the staging buffers' alignment


class Entry(NamedTuple):
    """Where a block is: its slot, and the write that put it there."""

    slot: int
    seq: int


class Item(NamedTuple):
    """A key of a store_many/load_many call that has its slot."""

    at: int  # its place in the call's keys
    entry: Entry
    direct: bool  # moved with O_DIRECT (through the staging buffer when staging)


def staging_buffer(nbytes: int) -> memoryview:
    """`nbytes` of private anonymous memory, 2 MiB aligned, asking for huge pages
    (shared anonymous memory is shmem, which gets none where shmem THP is off)."""
    raw = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        raw.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP: ordinary pages, still correct
        pass
    view = memoryview(raw)
    start = -buffer_address(view) % HUGE
    return view[start:start + nbytes]  # keeps `raw` alive


class RunIO:
    """Moves runs of adjacent slots between the slab files and callers' buffers.

    `stage`: O_DIRECT runs go through a per-thread staging buffer (above);
    otherwise straight between the slab and the callers' buffers, header pages
    from a per-thread buffer."""

    def __init__(self, slabs: SlabFiles, block_bytes: int, slot_bytes: int, namespace: bytes,
                 run_slots: int, stage: bool) -> None:
        self.slabs = slabs
        self.block_bytes = block_bytes
        self.slot_bytes = slot_bytes
        self.namespace = namespace
        # Padded slots (blocks not a multiple of 4 KiB) are not one byte run.
        self.adjacent = slot_bytes == HEADER_AREA + block_bytes
        self.run_slots = max(1, min(MAX_RUN, run_slots)) if self.adjacent else 1
        self.stage = stage and self.adjacent
        self._tls = threading.local()

    def runs(self, items: list[Item]) -> list[list[Item]]:
        """`items` in runs of adjacent slots of one slab, moved the same way,
        at most `run_slots` long."""
        per_slab = self.slabs.slots_per_slab
        runs: list[list[Item]] = []
        for item in sorted(items, key=lambda it: it.entry.slot):
            if runs and self.adjacent:
                run = runs[-1]
                last, slot = run[-1].entry.slot, item.entry.slot
                if (slot == last + 1 and slot // per_slab == last // per_slab
                        and item.direct == run[-1].direct and len(run) < self.run_slots):
                    run.append(item)
                    continue
            runs.append([item])
        return runs

    def write(self, run: list[Item], keys: Sequence[bytes], srcs: Sequence[memoryview]) -> int:
        """One `pwritev` of the run's headers and payloads. Returns the buffered
        descriptor, which fdatasync uses."""
        n, offset = self.slabs.locate(run[0].entry.slot)
        slab = self.slabs.get(n)
        if run[0].direct and self.stage:
            iov = [self._staged_for_write(run, keys, srcs)]
        else:
            headers = self._headers(len(run))
            iov = []
            for k, item in enumerate(run):
                header = headers[k * HEADER_AREA:(k + 1) * HEADER_AREA]
                src = srcs[item.at]
                header[:HEADER_SIZE] = pack_header(keys[item.at], self.namespace, src,
                                                   item.entry.seq)
                header[HEADER_SIZE:] = ZERO_PAGE_TAIL
                iov += (header, src)
        total = sum(len(b) for b in iov)
        done = os.pwritev(slab.dfd if run[0].direct else slab.fd, iov, offset)
        if done != total:  # a short write: finish it plainly
            rest = b"".join(bytes(b) for b in iov)[done:]
            while rest:
                wrote = os.pwrite(slab.fd, rest, offset + total - len(rest))
                rest = rest[wrote:]
        return slab.fd

    def read(self, run: list[Item], keys: Sequence[bytes],
             dsts: Sequence[memoryview]) -> list[CorruptBlock | None]:
        """One `preadv` of the run's slots, each block verified: what is wrong with
        each (None: it is whole, and in its buffer). A staged read copies only the
        blocks that pass; a direct one leaves garbage in a failed block's buffer,
        but its key fails, so no one takes it as data."""
        n, offset = self.slabs.locate(run[0].entry.slot)
        slab = self.slabs.get(n)
        staged = run[0].direct and self.stage
        if staged:
            buf = self._staging(len(run) * self.slot_bytes)
            got = os.preadv(slab.dfd, [buf], offset)
        else:
            buf = self._headers(len(run))
            iov: list[memoryview] = []
            for k, item in enumerate(run):
                iov += (buf[k * HEADER_AREA:(k + 1) * HEADER_AREA], dsts[item.at])
            got = os.preadv(slab.dfd if run[0].direct else slab.fd, iov, offset)
        stride = self.slot_bytes if staged else HEADER_AREA
        found: list[CorruptBlock | None] = []
        for k, item in enumerate(run):
            start = k * self.slot_bytes
            header = buf[k * stride:k * stride + HEADER_SIZE]
            payload = buf[start + HEADER_AREA:start + self.slot_bytes] if staged else dsts[item.at]
            try:
                self._check(item.entry, got - start, header, keys[item.at], payload)
            except CorruptBlock as e:
                found.append(detached(e))
                continue
            if staged:
                np.frombuffer(dsts[item.at], dtype=np.uint8)[:] = np.frombuffer(
                    payload, dtype=np.uint8)
            found.append(None)
        return found

    def _check(self, entry: Entry, have: int, header: memoryview, key: bytes,
               payload: memoryview) -> None:
        if have < HEADER_AREA + len(payload):
            raise CorruptBlock(f"slot {entry.slot} is truncated ({max(0, have)} bytes)")
        parsed = unpack_header(header)
        verify(parsed, key, self.namespace, payload)
        if parsed.seq != entry.seq:
            raise CorruptBlock(f"slot {entry.slot} holds write {parsed.seq}, not {entry.seq}")

    def _staged_for_write(self, run: list[Item], keys: Sequence[bytes],
                          srcs: Sequence[memoryview]) -> memoryview:
        """The run laid out as on disk in the staging buffer: each payload copied
        in, then its header, checksummed from the copy (the bytes written)."""
        buf = self._staging(len(run) * self.slot_bytes)
        flat = np.frombuffer(buf, dtype=np.uint8)
        for k, item in enumerate(run):
            start = k * self.slot_bytes
            body = start + HEADER_AREA
            flat[body:start + self.slot_bytes] = np.frombuffer(srcs[item.at], dtype=np.uint8)
            buf[start:start + HEADER_SIZE] = pack_header(
                keys[item.at], self.namespace, buf[body:start + self.slot_bytes],
                item.entry.seq)
            buf[start + HEADER_SIZE:body] = ZERO_PAGE_TAIL
        return buf

    def _headers(self, count: int) -> memoryview:
        """Page-aligned header pages of this thread, as O_DIRECT needs."""
        buf = getattr(self._tls, "headers", None)
        if buf is None or len(buf) < count * HEADER_AREA:
            buf = self._tls.headers = memoryview(mmap.mmap(-1, count * HEADER_AREA))
        return buf[:count * HEADER_AREA]

    def _staging(self, nbytes: int) -> memoryview:
        """This thread's staging buffer (a run's worth, made on first use)."""
        buf = getattr(self._tls, "staging", None)
        if buf is None or len(buf) < nbytes:
            buf = self._tls.staging = staging_buffer(max(nbytes,
                                                         self.run_slots * self.slot_bytes))
        return buf[:nbytes]
