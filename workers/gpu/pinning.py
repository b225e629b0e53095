"""Pinning the CPU tier for DMA (``cudaHostRegister``), once per process and region.

Why it matters: a copy between the GPU and pageable memory is synchronous and goes
through CUDA's own bounce buffer, at a fraction of the bus speed; only registered
(page-locked) memory is real asynchronous DMA. So an unpinned region is refused
unless the node's config allows it (``[gpu] allow_unpinned = true``), and the
pinned state is reported (worker hello, ``tierkv status``, metrics, gpu-check).

Why here and early: registering tens of GiB takes seconds (every page is faulted
in and locked). The gpu worker pins its region before it says hello to the broker,
not in its serve loop, where it would miss heartbeats and be fenced.

Registration is reference counted per address, so the worker's early pin and the
copy backend's own share one registration; the last reference unregisters. It uses
``cudaHostRegisterPortable``: the pages count as pinned for every device's context,
so a KV cache on another GPU than the one the worker pinned with still gets DMA.
Every call runs under the given device, so no context is created on GPU 0 by a
worker of another GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("tierkv.pinning")

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class UnpinnedRefused(RuntimeError):
    """The region could not be pinned and the config does not allow unpinned copies."""


@dataclass(frozen=True)
class Pinned:
    """The outcome of pinning [ptr, ptr+size): pinned or not, how long it took, and
    CUDA's error when it failed."""

    ptr: int
    size: int
    pinned: bool
    seconds: float = 0.0
    error: str = ""


_LOCK = threading.Lock()
_ENTRIES: dict[int, list[int]] = {}  # address -> [references, size, registered 0/1]


def _device_guard(device: int | None) -> contextlib.AbstractContextManager[object]:
    if device is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)


def pin_host(ptr: int, size: int, device: int | None = None) -> Pinned:
    """Register [ptr, ptr+size) unless this process already did (one more reference
    then). Never raises for a CUDA error: the result says whether it is pinned."""
    with _LOCK:
        entry = _ENTRIES.get(ptr)
        if entry is not None:
            entry[0] += 1
            return Pinned(ptr, size, bool(entry[2]))
        import torch

        from workers.gpu.cudart import cuda_runtime

        start = time.perf_counter()
        with _device_guard(device):
            rc = int(torch.cuda.cudart().cudaHostRegister(ptr, size,
                                                         CUDA_HOST_REGISTER_PORTABLE))
            seconds = time.perf_counter() - start
            runtime = cuda_runtime()
            error = ""
            if rc != 0:
                name = runtime.error_name(rc) if runtime is not None else "unknown"
                error = f"cudaHostRegister failed with cudaError {rc} ({name})"
                if runtime is not None:
                    runtime.clear_error()
        ok = rc == 0
        _ENTRIES[ptr] = [1, size, int(ok)]
        if ok:
            log.info("pinned %.1f GiB for DMA in %.2f s", size / 2**30, seconds)
        return Pinned(ptr, size, ok, seconds, error)


def unpin_host(ptr: int, device: int | None = None) -> float:
    """Drop one reference; the last one unregisters (the copies must be finished).
    Returns the seconds the unregistration took (0 if it was not the last)."""
    with _LOCK:
        entry = _ENTRIES.get(ptr)
        if entry is None:
            return 0.0
        entry[0] -= 1
        if entry[0] > 0:
            return 0.0
        del _ENTRIES[ptr]
        if not entry[2]:
            return 0.0
        import torch

        from workers.gpu.cudart import cuda_runtime

        start = time.perf_counter()
        with _device_guard(device):
            rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
            if rc != 0:
                runtime = cuda_runtime()
                if runtime is not None:
                    runtime.clear_error()
                log.warning("cudaHostUnregister failed with cudaError %d", rc)
        return time.perf_counter() - start


def is_pinned(ptr: int) -> bool | None:
    """This process's registration of `ptr`: True, False (tried, failed), None (never)."""
    with _LOCK:
        entry = _ENTRIES.get(ptr)
        return None if entry is None else bool(entry[2])


def refuse_message(pinned: Pinned) -> str:
    """Why an unpinned region is refused, and the two ways out."""
    return (f"cannot pin the CPU tier ({pinned.size / 2**30:.1f} GiB) for DMA: "
            f"{pinned.error or 'not registered'}. Unpinned, every copy is synchronous and "
            "several times slower. Raise the locked-memory limit (ulimit -l / "
            "LimitMEMLOCK=infinity), or set [gpu] allow_unpinned = true to run anyway")
