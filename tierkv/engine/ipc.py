"""CUDA IPC bookkeeping shared by the engine (exporter) and the worker (importer):
the exporter's reference counters, and why an allocator's memory cannot be shared.

Reference counting, and why tierkv adjusts it. torch keeps, per exported storage,
an int64 counter in a shared-memory file of the exporting process
(``ref_counter``/``ref_counter_offset`` in the registration): ``_share_cuda_`` sets
it to 1, and an importer's storage decrements it once when it is freed. The
exporter frees the memory (or lets its caching allocator reuse it) only once the
counter is back to 0. That suits one export, one import. A registration is
imported again whenever a worker restarts (the broker re-sends it), so the counter
would be decremented once per worker that ever opened it: after a clean worker
restart it reaches 0 while the new worker still writes into the memory.

So the counter counts holders here: a worker takes a reference before it imports
(`take_reference`) and torch's deleter gives it back; the engine gives back the
export's own reference when it closes its `KVCache` (`drop_reference`). A worker
that cannot take its reference refuses to import rather than map memory the engine
could reuse under it.

The counter file is torch's RefcountedMapAllocator mapping: a 64-byte header, then
the int64 counters (the CPU tests check this against torch's own allocator).
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import posix_ipc

from tierkv.engine.layout import KVCacheError

COUNTER_HEADER = 64  # RefcountedMapAllocator's header before the data
_MAX_SANE = 1 << 24  # a counter above this is not a counter: wrong file layout
_LOCK = threading.Lock()  # one process's own adjustments never interleave


def _counter_map(handle: bytes, offset: int) -> tuple[mmap.mmap, int]:
    name = handle.decode(errors="strict") if isinstance(handle, bytes) else str(handle)
    if not name.startswith("/"):
        name = "/" + name
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError as e:
        raise KVCacheError(f"the engine's CUDA IPC counter file {name} is gone (the engine "
                           "exited?)") from e
    try:
        size = os.fstat(shm.fd).st_size
        position = COUNTER_HEADER + 8 * offset
        if offset < 0 or position + 8 > size:
            raise KVCacheError(f"CUDA IPC counter offset {offset} is outside {name} "
                               f"({size} bytes)")
        return mmap.mmap(shm.fd, size), position
    finally:
        shm.close_fd()


def read_counter(handle: bytes, offset: int) -> int:
    mm, position = _counter_map(handle, offset)
    try:
        return int.from_bytes(mm[position : position + 8], "little", signed=True)
    finally:
        mm.close()


def adjust_counter(handle: bytes, offset: int, delta: int) -> int:
    """Add `delta` to one counter; returns the new value. Raises KVCacheError when
    the file is gone or does not hold a counter there."""
    with _LOCK:
        mm, position = _counter_map(handle, offset)
        try:
            value = int.from_bytes(mm[position : position + 8], "little", signed=True)
            if not 0 <= value <= _MAX_SANE or value + delta < 0:
                raise KVCacheError(
                    f"CUDA IPC counter {offset} reads {value}: not a reference count this "
                    "torch version keeps where tierkv expects it")
            mm[position : position + 8] = (value + delta).to_bytes(8, "little", signed=True)
            return value + delta
        finally:
            mm.close()


def take_reference(storage: dict[str, Any]) -> None:
    """The importing worker's reference on one exported storage (registration entry)."""
    adjust_counter(storage["ref_counter"], storage["ref_counter_offset"], +1)


def drop_reference(storage: dict[str, Any]) -> None:
    """Give one reference back; a counter file already gone is not an error."""
    try:
        adjust_counter(storage["ref_counter"], storage["ref_counter_offset"], -1)
    except KVCacheError:
        pass


# -- allocators whose memory cannot be exported -------------------------------------------


def allocator_settings() -> str:
    """What decides how the engine's CUDA memory is allocated, in one line."""
    parts = [f"{k}={os.environ[k]!r}" for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
             if os.environ.get(k)]
    try:
        import torch

        parts.append(f"allocator backend {torch.cuda.get_allocator_backend()}")
    except (ImportError, RuntimeError, AttributeError):
        pass
    return ", ".join(parts) or "default allocator settings"


def export_failure(error: BaseException | str, settings: str, handle: bytes = b"") -> str:
    """Why CUDA memory could not be shared (by the engine) or opened (by the worker),
    naming the allocator setting that causes it, then CUDA's/torch's own words."""
    text = str(error)
    low = (text + " " + settings).lower()
    if "cudamallocasync" in low:
        why = ("memory from cudaMallocAsync pools (PYTORCH_CUDA_ALLOC_CONF=backend:"
               "cudaMallocAsync) cannot be shared by CUDA IPC handle: allocate the KV cache "
               "with the native caching allocator")
    elif "expandable_segments:true" in low or handle[1:2] == b"e":
        why = ("memory of expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
               "True) is shared only with TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=1 (torch 2.5+), "
               "and the worker must be allowed to import its file descriptors; or allocate "
               "the KV cache without expandable segments")
    elif "pluggable" in low or "mempool" in low or "sleep" in low:
        why = ("memory of a pluggable allocator or private memory pool (vLLM's sleep mode, "
               "enable_sleep_mode=True / CuMemAllocator) cannot be shared by CUDA IPC handle: "
               "allocate the KV cache outside that pool")
    else:
        why = ("the KV cache memory cannot be shared by CUDA IPC handle (it must come from "
               "torch's native caching allocator: no cudaMallocAsync backend, no expandable "
               "segments, no pluggable allocator or sleep-mode pool)")
    return f"{why}; allocator: {settings}; error: {text}"
