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

In pieces: the region is registered `PIECE_BYTES` at a time, not as one range. One
``cudaHostRegister`` of tens of GiB is one call the driver must satisfy whole (some
drivers and IOMMU setups refuse single ranges that large, and the call cannot be
interrupted); pieces stay within what every driver we target accepts for one
registration, and a failure names the piece. If any piece fails, the pieces already
registered are unregistered: a region is pinned whole or not at all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("tierkv.pinning")

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
#: Bytes registered by one ``cudaHostRegister`` call (the last piece may be shorter).
#: 1 GiB: far below any per-registration limit, few enough calls (16 for 16 GiB) that
#: their overhead does not show next to faulting the pages in.
PIECE_BYTES = 1 << 30


class HostRegistrar(Protocol):
    """The runtime's page-locking calls (a seam: the CPU tests record them)."""

    def register(self, ptr: int, size: int) -> int:
        """``cudaHostRegister(ptr, size, portable)``: 0 or the cudaError code."""

    def unregister(self, ptr: int) -> int:
        """``cudaHostUnregister(ptr)``: 0 or the cudaError code."""

    def error_name(self, rc: int) -> str:
        """The cudaError's name; clears the runtime's last error."""


class CudartRegistrar:
    """`HostRegistrar` through torch's cudart and the loaded CUDA runtime."""

    def register(self, ptr: int, size: int) -> int:
        import torch

        return int(torch.cuda.cudart().cudaHostRegister(ptr, size,
                                                        CUDA_HOST_REGISTER_PORTABLE))

    def unregister(self, ptr: int) -> int:
        import torch

        return int(torch.cuda.cudart().cudaHostUnregister(ptr))

    def error_name(self, rc: int) -> str:
        from workers.gpu.cudart import cuda_runtime

        runtime = cuda_runtime()
        if runtime is None:
            return "unknown"
        name = runtime.error_name(rc)
        runtime.clear_error()
        return name


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


@dataclass
class _Entry:
    """This process's registration of one region: its references, the pieces it
    registered (empty: it failed) and the calls that unregister them."""

    references: int
    pieces: list[int]
    registrar: HostRegistrar


_LOCK = threading.Lock()
_ENTRIES: dict[int, _Entry] = {}  # address -> its registration


def _device_guard(device: int | None) -> contextlib.AbstractContextManager[object]:
    if device is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)


def pin_host(ptr: int, size: int, device: int | None = None,
             registrar: HostRegistrar | None = None) -> Pinned:
    """Register [ptr, ptr+size) in pieces of `PIECE_BYTES` unless this process already
    did (one more reference then). Never raises for a CUDA error: the result says
    whether it is pinned, and if not, which piece failed (none stays registered)."""
    with _LOCK:
        entry = _ENTRIES.get(ptr)
        if entry is not None:
            entry.references += 1
            return Pinned(ptr, size, bool(entry.pieces))
        calls = registrar or CudartRegistrar()
        pieces: list[int] = []
        error = ""
        start = time.perf_counter()
        with _device_guard(device):
            for at in range(ptr, ptr + size, PIECE_BYTES):
                rc = calls.register(at, min(PIECE_BYTES, ptr + size - at))
                if rc != 0:
                    error = (f"cudaHostRegister failed with cudaError {rc} "
                             f"({calls.error_name(rc)}) on the piece at "
                             f"{(at - ptr) / 2**30:.1f} GiB of {size / 2**30:.1f} GiB "
                             f"(pieces of {PIECE_BYTES / 2**30:g} GiB; none left pinned)")
                    _unregister(calls, pieces)
                    pieces = []
                    break
                pieces.append(at)
        seconds = time.perf_counter() - start
        _ENTRIES[ptr] = _Entry(1, pieces, calls)
        if pieces:
            log.info("pinned %.1f GiB for DMA in %.2f s (%d pieces)", size / 2**30, seconds,
                     len(pieces))
        return Pinned(ptr, size, bool(pieces), seconds, error)


def _unregister(calls: HostRegistrar, pieces: list[int]) -> None:
    """Unregister every piece (a failure is logged: the others still go)."""
    for at in pieces:
        rc = calls.unregister(at)
        if rc != 0:
            log.warning("cudaHostUnregister failed with cudaError %d (%s)", rc,
                        calls.error_name(rc))


def unpin_host(ptr: int, device: int | None = None) -> float:
    """Drop one reference; the last one unregisters (the copies must be finished).
    Returns the seconds the unregistration took (0 if it was not the last)."""
    with _LOCK:
        entry = _ENTRIES.get(ptr)
        if entry is None:
            return 0.0
        entry.references -= 1
        if entry.references > 0:
            return 0.0
        del _ENTRIES[ptr]
        if not entry.pieces:
            return 0.0
        start = time.perf_counter()
        with _device_guard(device):
            _unregister(entry.registrar, entry.pieces)
        return time.perf_counter() - start


def is_pinned(ptr: int) -> bool | None:
    """This process's registration of `ptr`: True, False (tried, failed), None (never)."""
    with _LOCK:
        entry = _ENTRIES.get(ptr)
        return None if entry is None else bool(entry.pieces)


def refuse_message(pinned: Pinned) -> str:
    """Why an unpinned region is refused, and the two ways out."""
    return (f"cannot pin the CPU tier ({pinned.size / 2**30:.1f} GiB) for DMA: "
            f"{pinned.error or 'not registered'}. Unpinned, every copy is synchronous and "
            "several times slower. Raise the locked-memory limit (ulimit -l / "
            "LimitMEMLOCK=infinity), or set [gpu] allow_unpinned = true to run anyway")
