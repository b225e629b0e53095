"""POSIX shared-memory segments that hold CPU KV caches, shared by the engine (which
creates and unlinks them) and the worker (which maps them by name)."""

from __future__ import annotations

import logging
import mmap
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import posix_ipc

from tierkv.core.shm import map_resident, owner_alive
from tierkv.engine.layout import DTYPE_SIZES, KVCacheError

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger("tierkv.engine")

_NAME_RE = re.compile(r"^/tierkv\.[^/\x00]+\.kv\d+\.(\d+)\.\d+$")


def kv_segment_name(instance: str, rank: int, pid: int, seq: int) -> str:
    """``/tierkv.<instance>.kv<rank>.<pid>.<seq>``: the pid makes a restarted engine's
    segment never collide with a crashed one's, and lets a sweep find dead owners."""
    return f"/tierkv.{instance}.kv{rank}.{pid}.{seq}"


def _map_segment(name: str, size: int | None = None) -> mmap.mmap:
    """Create (size given: exclusively, mode 0600) or open a segment and map it."""
    try:
        if size is None:
            shm = posix_ipc.SharedMemory(name)
        else:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    except posix_ipc.ExistentialError as e:
        what = "already exists" if size is not None else "does not exist (engine gone?)"
        raise KVCacheError(f"shared memory {name} {what}") from e
    try:
        if size is not None:
            return mmap.mmap(shm.fd, size)
        mm = mmap.mmap(shm.fd, shm.size)
        map_resident(mm, shm.fd)  # the worker copies through the engine's pages
        return mm
    except OSError:
        if size is not None:
            shm.unlink()
        raise
    finally:
        shm.close_fd()


def _tensors_on_buffer(
    mm: mmap.mmap, specs: Sequence[tuple[int, Sequence[int], Sequence[int]]], dtype: str
) -> list[torch.Tensor]:
    """Tensors (offset bytes, shape, stride) viewing `mm`. Bounds were checked by the
    caller. Through numpy, so each tensor holds a buffer export of the map: closing
    the map while a view lives raises BufferError instead of leaving it dangling."""
    import numpy as np
    import torch

    base = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    tdtype = getattr(torch, dtype)
    out = []
    for offset, shape, stride in specs:
        nbytes = _span_bytes(shape, stride, DTYPE_SIZES[dtype])
        flat = base[offset : offset + nbytes].view(tdtype)
        out.append(flat.as_strided(tuple(shape), tuple(stride)))
    return out


def _bytes_on_buffer(mm: mmap.mmap, offset: int, shape: Sequence[int], stride: Sequence[int],
                     itemsize: int) -> np.ndarray:
    """One tensor (offset bytes, shape, stride in elements) viewing `mm` as uint8, its
    last dimension `itemsize` times longer: what a CPU worker copies, without torch.
    Bounds were checked by the caller; the view holds a buffer export of the map,
    as `_tensors_on_buffer`'s do."""
    import numpy as np

    shape, stride = list(shape), list(stride)
    if itemsize > 1 and shape and shape[-1] > 1 and stride[-1] != 1:
        raise KVCacheError(f"a KV tensor's last dimension must be contiguous, its stride is "
                           f"{stride[-1]}")
    if shape:
        shape[-1] *= itemsize
        stride = [s * itemsize for s in stride[:-1]] + [1]
    base = np.frombuffer(mm, dtype=np.uint8, count=_span_bytes(shape, stride, 1), offset=offset)
    return np.lib.stride_tricks.as_strided(base, tuple(shape), tuple(stride), writeable=True)


def _span_bytes(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """Bytes from a tensor's first element to just past its last."""
    if any(d == 0 for d in shape):
        return 0
    return (sum((d - 1) * s for d, s in zip(shape, stride, strict=True)) + 1) * itemsize


def _close_map(mm: mmap.mmap, name: str) -> None:
    try:
        mm.close()
    except BufferError:
        log.warning("%s: views still alive at close; unmapped when they are freed", name)


def sweep_stale_kv_segments(instance: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the KV segments of `instance` whose owner pid is dead (a crashed
    engine). Returns the names removed. Run by whoever starts an engine."""
    removed: list[str] = []
    try:
        entries = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = _NAME_RE.match("/" + entry)
        if not m or not entry.startswith(f"tierkv.{instance}.kv"):
            continue
        if owner_alive(int(m.group(1)), 0):
            continue
        try:
            posix_ipc.unlink_shared_memory("/" + entry)
            removed.append(entry)
        except posix_ipc.ExistentialError:
            pass
    return removed

