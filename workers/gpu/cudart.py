"""The CUDA runtime calls torch does not expose, made through the libcudart torch
loaded, and the choice of DMA path they allow.

Why ctypes: torch exposes ``cudaHostRegister`` (``torch.cuda.cudart()``) but not
``cudaMemcpy2DAsync``, ``cudaMemcpyBatchAsync`` or ``cudaGetLastError``. Calling the
library torch already loaded (found in ``/proc/self/maps``) keeps one runtime, one
context and one error state in the process.

Every call fails soft: a runtime without a call is described by `Runtime` (which
calls it has, its version, its path), `choose_dma_path` picks the best path it
allows and says why the others were not taken, and a call that fails raises
`CudaCallError` with CUDA's own error name, after clearing the runtime's "last
error" so that torch's next kernel-launch check does not report it again.

``cudaMemcpyBatchAsync`` exists from CUDA 12.8; CUDA 13.0 removed its ``failIdx``
argument, so the call is made with 9 arguments on 12.8/12.9 and 8 from 13.0 on (the
runtime's own version decides, never a guess).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("tierkv.cudart")

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (UVA)
BATCH_MIN_RUNTIME = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
BATCH_NO_FAILIDX_RUNTIME = 13000  # ... and lost its failIdx argument in 13.0
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute: copy engines

#: The DMA paths, best first: one batched call per chunk; one 2D copy per run of
#: consecutive CPU ids; one torch ``copy_`` per run (or per row when rows are strided).
DMA_PATHS = ("batch", "2d", "copy")


class CudaCallError(RuntimeError):
    """A CUDA runtime call returned an error; the message names the call and the error."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: cudaError {code} ({name})")
        self.call = call
        self.code = code


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes (CUDA 12.8+): access order, two location hints, flags."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


_P = ctypes.c_void_p
_SZ = ctypes.c_size_t


class Runtime:
    """One loaded libcudart: its version, the calls it has, and typed wrappers.

    Methods run on any thread; the CUDA runtime is thread safe. Each wrapper raises
    `CudaCallError` on failure (the error is cleared first)."""

    def __init__(self, lib: Any, path: str) -> None:
        self.lib = lib
        self.path = path
        self.version = _version(lib, "cudaRuntimeGetVersion")
        self.driver_version = _version(lib, "cudaDriverGetVersion")
        self.has_2d = _bind(lib, "cudaMemcpy2DAsync", [_P, _SZ, _P, _SZ, _SZ, _SZ,
                                                       ctypes.c_int, _P])
        self.has_last_error = _bind(lib, "cudaGetLastError", [])
        _bind(lib, "cudaGetErrorName", [ctypes.c_int], ctypes.c_char_p)
        batch_args = [_P, _P, _P, _SZ, _P, _P, _SZ]
        self._batch_failidx = self.version < BATCH_NO_FAILIDX_RUNTIME
        batch_args += [_P, _P] if self._batch_failidx else [_P]
        self.has_batch = self.version >= BATCH_MIN_RUNTIME and _bind(
            lib, "cudaMemcpyBatchAsync", batch_args)
        attrs = _MemcpyAttributes()
        attrs.srcAccessOrder = SRC_ACCESS_ORDER_STREAM
        attrs.flags = FLAG_PREFER_OVERLAP_WITH_COMPUTE
        self._attrs = attrs
        self._attr_index = (ctypes.c_size_t * 1)(0)
        self._fail_index = ctypes.c_size_t(0)

    def __repr__(self) -> str:
        return (f"Runtime({self.path}, runtime {version_text(self.version)}, driver "
                f"{version_text(self.driver_version)}, batch={self.has_batch}, "
                f"2d={self.has_2d})")

    # -- errors ---------------------------------------------------------------------

    def clear_error(self) -> None:
        """Reset the "last error" a failed call leaves (torch checks it after every
        kernel launch and would blame the next kernel for it)."""
        if self.has_last_error:
            self.lib.cudaGetLastError()

    def error_name(self, code: int) -> str:
        try:
            name = self.lib.cudaGetErrorName(code)
        except (AttributeError, ctypes.ArgumentError):
            return "unknown"
        return name.decode(errors="replace") if name else "unknown"

    def check(self, call: str, rc: int) -> None:
        if rc != 0:
            self.clear_error()
            raise CudaCallError(call, rc, self.error_name(rc))

    # -- copies ---------------------------------------------------------------------

    def memcpy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                  height: int, stream: int) -> None:
        rc = self.lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                        CUDA_MEMCPY_DEFAULT, stream)
        self.check("cudaMemcpy2DAsync", rc)

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                     stream: int) -> None:
        """One cudaMemcpyBatchAsync of ``len(dsts)`` 1D copies (uint64 arrays that stay
        alive during the call; the runtime reads them before returning)."""
        count = len(dsts)
        if count == 0:
            return
        args: list[Any] = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count,
                           ctypes.addressof(self._attrs), ctypes.addressof(self._attr_index), 1]
        if self._batch_failidx:
            args.append(ctypes.addressof(self._fail_index))
        args.append(stream)
        self.check("cudaMemcpyBatchAsync", self.lib.cudaMemcpyBatchAsync(*args))


def _version(lib: Any, name: str) -> int:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return 0
    out = ctypes.c_int(0)
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_int
    return out.value if fn(ctypes.byref(out)) == 0 else 0


def _bind(lib: Any, name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> bool:
    """Declare `name`'s signature; False if the library does not export it."""
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return False
    fn.argtypes = argtypes
    fn.restype = restype
    return True


def version_text(version: int) -> str:
    """12080 -> "12.8"; 0 -> "unknown"."""
    return f"{version // 1000}.{version % 1000 // 10}" if version else "unknown"


# -- finding the runtime -----------------------------------------------------------------

_RUNTIME: Runtime | None = None
_LOOKED = False


def loaded_cudart_paths(maps: str = "/proc/self/maps") -> list[str]:
    """The libcudart files mapped into this process (the one torch loaded)."""
    try:
        with open(maps) as f:
            return sorted({line.split()[-1] for line in f
                           if "libcudart.so" in line.rsplit("/", 1)[-1]})
    except OSError:
        return []


def cuda_runtime() -> Runtime | None:
    """The libcudart torch loaded, else one on the loader path; None when there is
    none (a statically linked torch): the caller then uses torch's own copies."""
    global _RUNTIME, _LOOKED
    if _LOOKED:
        return _RUNTIME
    _LOOKED = True
    import torch

    torch.cuda.init()
    for name in [*loaded_cudart_paths(), "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        _RUNTIME = Runtime(lib, name)
        log.debug("CUDA runtime: %r", _RUNTIME)
        break
    return _RUNTIME


# -- which DMA path --------------------------------------------------------------------


@dataclass(frozen=True)
class DmaChoice:
    path: str  # one of DMA_PATHS
    reason: str  # why not a better one ("" for the best)


def choose_dma_path(runtime: Runtime | None,
                    env: Mapping[str, str] | None = None) -> DmaChoice:
    """The best DMA path `runtime` allows. ``TIERKV_CUDA_DMA=batch|2d|copy`` asks for
    one (granted only if the runtime has it); ``TIERKV_CUDA_NO_MEMCPY2D=1`` (older
    name) means ``copy``."""
    if env is None:
        env = os.environ
    wanted = env.get("TIERKV_CUDA_DMA", "").strip().lower()
    if env.get("TIERKV_CUDA_NO_MEMCPY2D", "") not in ("", "0"):
        wanted = "copy"
    if wanted and wanted not in DMA_PATHS:
        log.warning("TIERKV_CUDA_DMA=%r is not one of %s: ignored", wanted, DMA_PATHS)
        wanted = ""
    if runtime is None:
        return DmaChoice("copy", "no libcudart found in this process (statically linked "
                         "torch?): one torch copy_ per run")
    available = [p for p, ok in (("batch", runtime.has_batch), ("2d", runtime.has_2d),
                                 ("copy", True)) if ok]
    if wanted:
        if wanted in available:
            return DmaChoice(wanted, f"asked for by TIERKV_CUDA_DMA={wanted}"
                             if wanted != available[0] else "")
        reason = f"TIERKV_CUDA_DMA={wanted} asked for, but {runtime.path} lacks it; "
    else:
        reason = ""
    best = available[0]
    if best == "batch":
        return DmaChoice(best, reason)
    if runtime.version < BATCH_MIN_RUNTIME:
        why = (f"cudaMemcpyBatchAsync needs CUDA runtime 12.8+, {runtime.path} is "
               f"{version_text(runtime.version)}")
    else:
        why = f"{runtime.path} does not export cudaMemcpyBatchAsync"
    if best == "2d":
        return DmaChoice(best, f"{reason}{why}: one cudaMemcpy2DAsync per run")
    return DmaChoice(best, f"{reason}{why}, nor cudaMemcpy2DAsync: one torch copy_ per run")
