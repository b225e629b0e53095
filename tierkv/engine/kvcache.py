"""The engine side of KV-cache registration.

An inference engine owns its KV cache tensors. To let a gpu worker (another process)
copy blocks between them and the CPU tier, the engine exports them once:

* CUDA tensors by CUDA IPC handle (`KVCache.from_tensors`); the engine keeps the
  tensors alive for as long as the registration is in use, and closes the `KVCache`
  when it lets them go (that gives back the export's reference, `tierkv.engine.ipc`).
  Memory that cannot be exported (cudaMallocAsync, expandable segments, a pluggable
  allocator such as vLLM's sleep mode) fails with a `KVCacheError` naming the
  allocator setting.
* CPU tensors live in POSIX shared memory that this module allocates
  (`allocate_kv_cache`); CPU tensors anywhere else cannot be shared and are refused.

`KVCache.registration()` is a plain msgpack-friendly dict that travels engine ->
broker -> worker (`RegisterKVRequest` / `AttachKV`); the worker opens it with
`tierkv.engine.opened.open_kv_cache`.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import posix_ipc

from tierkv.core.shm import RegionError, _check_free_shm, _check_instance, align_up, allocate_pages
from tierkv.engine.layout import REGISTRATION_VERSION, KVCacheError, KVLayout, check_tensors
from tierkv.engine.segments import (
    _close_map,
    _map_segment,
    _span_bytes,
    _tensors_on_buffer,
    kv_segment_name,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tierkv.engine")

_SEQ = itertools.count()
# Live segments allocated by this process, by name. `from_tensors` looks CPU tensors
# up here; weak, so a forgotten cache can still be collected.
_LIVE: weakref.WeakValueDictionary[str, KVCache] = weakref.WeakValueDictionary()
_LIVE_LOCK = threading.Lock()



def _tensor_offsets(layout: KVLayout) -> tuple[list[int], int]:
    """Byte offset of each tensor in a segment (4 KiB aligned) and the segment size."""
    offsets, pos = [], 0
    for i in range(len(layout.tensor_shapes)):
        offsets.append(pos)
        pos = align_up(pos + layout.tensor_bytes(i))
    return offsets, pos



class KVCache:
    """The engine process's KV cache and its registration. Runs in the engine
    process; nothing here blocks except allocation (page-table setup)."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        layout: KVLayout,
        registration: dict[str, Any],
        mm: mmap.mmap | None = None,
        segment: str | None = None,
        keep: Any = None,
    ) -> None:
        self.tensors = tensors
        self.layout = layout
        self._registration = registration
        self._mmap = mm
        self.segment = segment  # set when this object owns a shm segment
        self._keep = keep  # CUDA: storages whose IPC export must outlive the worker's use
        self._base = 0  # address and size of the owned segment's map (from_tensors lookup)
        self._size = 0
        self._closed = False

    @property
    def device(self) -> str:
        return self._registration["device"]

    def registration(self) -> dict[str, Any]:
        """The msgpack-serializable description a worker opens with `open_kv_cache`."""
        if self._closed:
            raise KVCacheError("the KV cache is closed")
        return self._registration

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], layout: KVLayout) -> KVCache:
        """Export tensors the engine already has. CUDA tensors by IPC handle (the
        engine must keep them alive); CPU tensors only if they live in a segment
        from `allocate_kv_cache` of this process."""
        tensors = list(tensors)
        check_tensors(tensors, layout)
        if tensors[0].device.type == "cuda":
            registration, keep = _export_cuda(tensors, layout)
            return cls(tensors, layout, registration, keep=keep)
        if tensors[0].device.type != "cpu":
            raise KVCacheError(f"KV tensors on {tensors[0].device} cannot be exported")
        return cls(tensors, layout, _export_cpu(tensors, layout))

    def close(self) -> None:
        """Drop the tensors; the owner of a segment unlinks it. Idempotent. A worker
        that still maps the segment keeps its mapping until it closes it."""
        if self._closed:
            return
        self._closed = True
        self.tensors = []
        if self._keep is not None:  # CUDA: the export's own reference on each storage
            from tierkv.engine.ipc import drop_reference

            for storage in self._registration.get("storages", []):
                drop_reference(storage)
        self._keep = None
        if self.segment is not None:
            with _LIVE_LOCK:
                _LIVE.pop(self.segment, None)
            try:
                posix_ipc.unlink_shared_memory(self.segment)
            except posix_ipc.ExistentialError:
                pass
        if self._mmap is not None:
            mm, self._mmap = self._mmap, None
            _close_map(mm, self.segment or "kv cache")

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVCache({self.device}, {len(self.layout.tensor_shapes)} tensors, {self.layout})"


def allocate_kv_cache(instance: str, rank: int, layout: KVLayout) -> KVCache:
    """A CPU KV cache in POSIX shared memory owned by the calling (engine) process,
    one segment holding every tensor at a 4 KiB aligned offset."""
    try:
        _check_instance(instance)
    except RegionError as e:
        raise KVCacheError(str(e)) from e
    if type(rank) is not int or rank < 0:
        raise KVCacheError(f"rank must be a non-negative integer, got {rank!r}")
    offsets, size = _tensor_offsets(layout)
    try:  # a segment larger than /dev/shm would SIGBUS on first touch, not fail here
        _check_free_shm(size)
    except RegionError as e:
        raise KVCacheError(f"KV cache of rank {rank}: {e}") from e
    name = kv_segment_name(instance, rank, os.getpid(), next(_SEQ))
    mm = _map_segment(name, size)
    try:
        allocate_pages(mm)  # allocated now, as the broker's region: the worker maps it whole
        specs = [
            (off, shape, _contiguous_stride(shape))
            for off, shape in zip(offsets, layout.tensor_shapes, strict=True)
        ]
        tensors = _tensors_on_buffer(mm, specs, layout.dtype)
    except Exception:
        mm.close()
        posix_ipc.unlink_shared_memory(name)
        raise
    registration = _cpu_registration(layout, [(name, size)], [(0, *s) for s in specs])
    kv = KVCache(tensors, layout, registration, mm=mm, segment=name)
    kv._base, kv._size = tensors[0].untyped_storage().data_ptr(), size
    with _LIVE_LOCK:
        _LIVE[name] = kv
    log.info("allocated %s: %d tensors, %.1f MiB", name, len(tensors), size / 2**20)
    return kv


def _contiguous_stride(shape: Sequence[int]) -> list[int]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return stride[::-1]


def _cpu_registration(
    layout: KVLayout,
    segments: Sequence[tuple[str | None, int]],
    tensors: Sequence[tuple[int, int, Sequence[int], Sequence[int]]],
) -> dict[str, Any]:
    return {
        "version": REGISTRATION_VERSION,
        "device": "cpu",
        "pid": os.getpid(),
        "layout": layout.to_dict(),
        "segments": [{"name": n, "size": s} for n, s in segments],
        "tensors": [
            {"source": src, "offset": off, "shape": list(shape), "stride": list(stride),
             "dtype": layout.dtype}
            for src, off, shape, stride in tensors
        ],
    }


def _export_cpu(tensors: list[torch.Tensor], layout: KVLayout) -> dict[str, Any]:
    """Registration for CPU tensors inside this process's tierkv KV segments."""
    with _LIVE_LOCK:
        live = [kv for kv in _LIVE.values() if kv._mmap is not None and kv.segment]
    segments: list[tuple[str | None, int]] = []
    entries: list[tuple[int, int, Sequence[int], Sequence[int]]] = []
    for i, t in enumerate(tensors):
        ptr = t.data_ptr()
        span = _span_bytes(t.shape, t.stride(), t.element_size())
        owner = next((kv for kv in live if kv._base <= ptr and ptr + span <= kv._base + kv._size),
                     None)
        if owner is None:
            raise KVCacheError(
                f"CPU KV tensor {i} is not in tierkv shared memory, so the worker process "
                "cannot see it: allocate the cache with tierkv.engine.allocate_kv_cache"
            )
        seg = (owner.segment, owner._size)
        if seg not in segments:
            segments.append(seg)
        entries.append((segments.index(seg), ptr - owner._base, t.shape, t.stride()))
    return _cpu_registration(layout, segments, entries)


def _export_cuda(
    tensors: list[torch.Tensor], layout: KVLayout
) -> tuple[dict[str, Any], list[Any]]:
    """IPC-export each distinct storage once (tensors may be views of one buffer)."""
    import torch

    from tierkv.engine.ipc import allocator_settings, export_failure

    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        raise KVCacheError(export_failure("the cudaMallocAsync backend is in use",
                                          allocator_settings()))
    storages: list[dict[str, Any]] = []
    index: dict[int, int] = {}
    keep = []
    entries = []
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in index:
            try:
                (device, handle, size, offset, ref_handle, ref_offset, event_handle,
                 event_sync) = storage._share_cuda_()
            except RuntimeError as e:
                raise KVCacheError(export_failure(e, allocator_settings())) from e
            index[key] = len(storages)
            storages.append({
                "device_index": int(device),
                "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
                "handle": bytes(handle),
                "size": int(size),
                "offset": int(offset),
                "ref_counter": bytes(ref_handle),
                "ref_counter_offset": int(ref_offset),
                "event_handle": bytes(event_handle) if event_handle is not None else None,
                "event_sync_required": bool(event_sync),
            })
            keep.append(storage)
        offset_bytes = t.storage_offset() * t.element_size()
        entries.append({
            "source": index[key], "offset": offset_bytes, "shape": list(t.shape),
            "stride": list(t.stride()), "dtype": layout.dtype,
        })
    registration = {
        "version": REGISTRATION_VERSION,
        "device": "cuda",
        "pid": os.getpid(),
        "layout": layout.to_dict(),
        "storages": storages,
        "tensors": entries,
    }
    return registration, keep
