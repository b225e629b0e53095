"""The host side of a chunk, as arrays of copies: built with numpy, issued in one call.

A chunk is up to `capacity` blocks of one job, sorted by CPU id; staging row ``i``
of the device staging buffer holds the chunk's ``i``-th block (a whole page, this
rank's bytes of the block). The host side is this rank's page of each CPU-tier
row: ``host_base + cpu_id * row + offset`` (``row`` is the row stride, ``offset =
rank * page``).

Why arrays: issuing one Python call per run costs microseconds of interpreter time
per run, and a scattered 1000-block job has hundreds of runs. The arrays are built
in a few vectorized numpy steps whatever the number of runs, and then go to the
runtime in one ``cudaMemcpyBatchAsync`` (`copies_1d`), or to a tight loop of
``cudaMemcpy2DAsync`` calls (`copies_2d`) where the runtime has no batch call.

Nothing here touches CUDA: the CPU tests check every address against real host
buffers with ``memmove``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workers.gpu.jobs import runs


@dataclass(frozen=True)
class HostSide:
    """Where this rank's pages are: the region's data base address, its row stride,
    this rank's byte offset in a row, and the page size."""

    base: int
    row: int
    offset: int
    page: int

    @property
    def contiguous(self) -> bool:
        """One rank, rows without padding: consecutive ids are one contiguous span."""
        return self.row == self.page and self.offset == 0


@dataclass(frozen=True)
class Copies1D:
    """One batched call's arguments: ``dst[i] <- src[i]``, ``size[i]`` bytes (uint64)."""

    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray

    def __len__(self) -> int:
        return len(self.dst)

    @property
    def nbytes(self) -> int:
        return int(self.size.sum())


@dataclass(frozen=True)
class Copies2D:
    """One cudaMemcpy2DAsync per entry: `height` rows of `width` bytes, rows `dpitch`
    apart at the destination and `spitch` apart at the source (int64 arrays)."""

    dst: np.ndarray
    dpitch: np.ndarray
    src: np.ndarray
    spitch: np.ndarray
    width: np.ndarray
    height: np.ndarray

    def __len__(self) -> int:
        return len(self.dst)

    @property
    def nbytes(self) -> int:
        return int((self.width * self.height).sum())

    def rows(self) -> list[tuple[int, int, int, int, int, int]]:
        """The entries as Python ints, for the loop that issues them."""
        return list(zip(self.dst.tolist(), self.dpitch.tolist(), self.src.tolist(),
                        self.spitch.tolist(), self.width.tolist(), self.height.tolist(),
                        strict=True))


def _check(cpu: np.ndarray) -> np.ndarray:
    cpu = np.asarray(cpu, dtype=np.int64)
    if len(cpu) > 1 and (np.diff(cpu) <= 0).any():
        raise ValueError("a chunk's CPU ids must be sorted and distinct")
    return cpu


def copies_1d(cpu: np.ndarray, host: HostSide, stage_base: int, to_host: bool) -> Copies1D:
    """The chunk as 1D copies: one per run of consecutive ids when the host rows are
    contiguous, else one per page (the batch call takes 1D copies only)."""
    cpu = _check(cpu)
    page = host.page
    if host.contiguous:
        starts, lengths = runs(cpu)
        host_addr = host.base + cpu[starts] * host.row
        stage_addr = stage_base + starts * page
        size = lengths * page
    else:
        host_addr = host.base + cpu * host.row + host.offset
        stage_addr = stage_base + np.arange(len(cpu), dtype=np.int64) * page
        size = np.full(len(cpu), page, dtype=np.int64)
    dst, src = (host_addr, stage_addr) if to_host else (stage_addr, host_addr)
    return Copies1D(dst.astype(np.uint64), src.astype(np.uint64), size.astype(np.uint64))


def copies_2d(cpu: np.ndarray, host: HostSide, stage_base: int, to_host: bool) -> Copies2D:
    """The chunk as one 2D copy per run of consecutive ids: the staging rows are
    packed (pitch = page), the host rows are `row` apart. A run over contiguous host
    rows is one flat span (height 1)."""
    cpu = _check(cpu)
    page = host.page
    starts, lengths = runs(cpu)
    host_addr = host.base + cpu[starts] * host.row + host.offset
    stage_addr = stage_base + starts * page
    if host.contiguous:
        width, height = lengths * page, np.ones_like(lengths)
        host_pitch = stage_pitch = width
    else:
        width, height = np.full_like(lengths, page), lengths
        host_pitch, stage_pitch = np.full_like(lengths, host.row), np.full_like(lengths, page)
    if to_host:
        return Copies2D(host_addr, host_pitch, stage_addr, stage_pitch, width, height)
    return Copies2D(stage_addr, stage_pitch, host_addr, host_pitch, width, height)
