"""The worker side of KV-cache registration: open what an engine registered.

`open_kv_cache(registration)` validates everything it is told (it arrived over a
socket) and returns an `OpenedKV` of tensors viewing the engine's memory. An engine
restart is a new registration: the worker detaches and closes the old `OpenedKV`
and opens the new one.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tierkv.engine.ipc import (
    allocator_settings,
    drop_reference,
    export_failure,
    take_reference,
)
from tierkv.engine.layout import (
    REGISTRATION_VERSION,
    KVCacheError,
    KVLayout,
    KVLayoutError,
    block_views,
    byte_block_views,
    check_tensors,
)
from tierkv.engine.segments import (
    _NAME_RE,
    _bytes_on_buffer,
    _close_map,
    _map_segment,
    _span_bytes,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger("tierkv.engine")

class OpenedKV:
    """The engine's KV cache as seen by the worker process: views of the engine's
    memory. Used by the worker's main thread; `close` must come after the transfer
    engine let go of it (`TransferEngine.attach` of the next one, or close).

    A CPU cache opened from its segments is held as numpy byte arrays
    (`byte_block_views`), and torch tensors are made of them only when asked for
    (`tensors`): a CPU worker copies with numpy, and importing torch takes it seconds
    at every start and 200 MB."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        layout: KVLayout,
        maps: list[tuple[str, mmap.mmap]] | None = None,
        source_pid: int = 0,
        byte_arrays: list[np.ndarray] | None = None,
    ) -> None:
        self._tensors = tensors
        self._bytes = byte_arrays or []
        self.layout = layout
        self.kind: str = tensors[0].device.type if tensors else "cpu"
        self.source_pid = source_pid
        self._maps = maps or []

    @classmethod
    def local(cls, tensors: Sequence[torch.Tensor], layout: KVLayout) -> OpenedKV:
        """Tensors of this very process (in-process engine, tests): no IPC, no copy."""
        tensors = list(tensors)
        check_tensors(tensors, layout)
        return cls(tensors, layout, source_pid=os.getpid())

    @property
    def tensors(self) -> list[torch.Tensor]:
        if not self._tensors and self._bytes:
            import torch

            dtype = self.layout.torch_dtype()
            self._tensors = [torch.from_numpy(a).view(dtype) for a in self._bytes]
        return self._tensors

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def closed(self) -> bool:
        return not self._tensors and not self._bytes

    def block_views(self) -> list[torch.Tensor]:
        return block_views(self.tensors, self.layout)

    def byte_block_views(self) -> list[np.ndarray]:
        """`block_views` as numpy arrays, for the CPU copy path (CPU caches only)."""
        if self._bytes:
            return byte_block_views(self._bytes, self.layout)
        return [v.numpy() for v in self.block_views()]

    def close(self) -> None:
        """Release the views, then unmap (CUDA: the IPC mappings close when the last
        view dies). Idempotent."""
        self._tensors, self._bytes = [], []
        maps, self._maps = self._maps, []
        for name, mm in maps:
            _close_map(mm, name)

    def __enter__(self) -> OpenedKV:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OpenedKV({self.kind}, {len(self.layout.tensor_shapes)} tensors)"


def open_kv_cache(registration: dict[str, Any]) -> OpenedKV:
    """Open an engine's registration in the worker process. Validates everything it
    is told (it arrived over a socket) and raises KVCacheError naming the field."""
    if not isinstance(registration, dict):
        raise KVCacheError(f"a registration must be a map, got {type(registration).__name__}")
    if registration.get("version") != REGISTRATION_VERSION:
        raise KVCacheError(
            f"registration version {registration.get('version')!r}, "
            f"this side reads version {REGISTRATION_VERSION}"
        )
    try:
        layout = KVLayout.from_dict(registration.get("layout"))
    except KVLayoutError as e:
        raise KVCacheError(f"registration layout: {e}") from e
    specs = _tensor_specs(registration.get("tensors"), layout)
    device = registration.get("device")
    pid = registration.get("pid", 0)
    if device == "cpu":
        return _open_cpu(registration.get("segments"), specs, layout, pid)
    if device == "cuda":
        tensors = _open_cuda(registration.get("storages"), specs, layout)
        return OpenedKV(tensors, layout, source_pid=pid if type(pid) is int else 0)
    raise KVCacheError(f"registration device must be 'cpu' or 'cuda', got {device!r}")


TensorSpec = tuple[int, int, list[int], list[int]]  # source, offset bytes, shape, stride


def _tensor_specs(entries: Any, layout: KVLayout) -> list[TensorSpec]:
    if not isinstance(entries, list) or len(entries) != len(layout.tensor_shapes):
        raise KVCacheError(
            f"registration must list {len(layout.tensor_shapes)} tensors, got {entries!r:.80}"
        )
    specs = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise KVCacheError(f"tensors[{i}] must be a map")
        src, off, shape, stride = (e.get(k) for k in ("source", "offset", "shape", "stride"))
        if type(src) is not int or src < 0 or type(off) is not int or off < 0:
            raise KVCacheError(f"tensors[{i}]: bad source {src!r} or offset {off!r}")
        if e.get("dtype") != layout.dtype:
            raise KVCacheError(f"tensors[{i}] dtype {e.get('dtype')!r}, layout says {layout.dtype}")
        if off % layout.itemsize:
            raise KVCacheError(f"tensors[{i}] offset {off} is not a multiple of the itemsize")
        if not isinstance(shape, list) or tuple(shape) != layout.tensor_shapes[i]:
            raise KVCacheError(
                f"tensors[{i}] shape {shape!r}, layout says {list(layout.tensor_shapes[i])}"
            )
        if (not isinstance(stride, list) or len(stride) != len(shape)
                or not all(type(s) is int and s >= 0 for s in stride)):
            raise KVCacheError(f"tensors[{i}] stride {stride!r} is invalid for shape {shape}")
        specs.append((src, off, shape, stride))
    return specs


def _open_cpu(segments: Any, specs: list[TensorSpec], layout: KVLayout, pid: Any) -> OpenedKV:
    if not isinstance(segments, list) or not segments:
        raise KVCacheError("registration of a CPU KV cache lists no segments")
    maps: list[tuple[str, mmap.mmap]] = []
    try:
        for j, seg in enumerate(segments):
            name, size = (seg.get("name"), seg.get("size")) if isinstance(seg, dict) else (0, 0)
            if not isinstance(name, str) or not _NAME_RE.match(name):
                raise KVCacheError(f"segments[{j}] name {name!r} is not a tierkv KV segment")
            mm = _map_segment(name)
            maps.append((name, mm))
            if type(size) is not int or mm.size() < size:
                raise KVCacheError(f"{name}: {mm.size()} bytes mapped, registration says {size!r}")
        arrays = []
        for i, (src, off, shape, stride) in enumerate(specs):
            if src >= len(maps):
                raise KVCacheError(f"tensors[{i}] source {src} is not one of {len(maps)} segments")
            name, mm = maps[src]
            end = off + _span_bytes(shape, stride, layout.itemsize)
            if end > mm.size():
                raise KVCacheError(
                    f"tensors[{i}] ends at byte {end}, past the {mm.size()} bytes of {name}"
                )
            arrays.append(_bytes_on_buffer(mm, off, shape, stride, layout.itemsize))
        byte_block_views(arrays, layout)
    except BaseException:
        arrays = []
        for name, mm in maps:
            _close_map(mm, name)
        raise
    return OpenedKV([], layout, maps, pid if type(pid) is int else 0, byte_arrays=arrays)


_STORAGE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "device_index": int, "device_uuid": str, "handle": bytes, "size": int, "offset": int,
    "ref_counter": bytes, "ref_counter_offset": int, "event_handle": (bytes, type(None)),
    "event_sync_required": bool,
}


def _open_cuda(storages: Any, specs: list[TensorSpec], layout: KVLayout) -> list[torch.Tensor]:
    """Open each exported storage once (CUDA IPC) and view the tensors on it. Must
    run in another process than the engine: CUDA refuses to open a handle in the
    process that exported it."""
    import torch

    if not torch.cuda.is_available():
        raise KVCacheError("the registration holds CUDA tensors but this worker has no CUDA")
    if not isinstance(storages, list) or not storages:
        raise KVCacheError("registration of a CUDA KV cache lists no storages")
    opened = []
    for j, s in enumerate(storages):
        bad = [k for k, tp in _STORAGE_FIELDS.items()
               if not isinstance(s, dict) or type(s.get(k)) not in _as_tuple(tp)]
        if bad:
            raise KVCacheError(f"storages[{j}]: missing or mistyped fields {bad}")
        device = _local_device(s["device_index"], s["device_uuid"])
        take_reference(s)  # torch's deleter gives it back (tierkv.engine.ipc)
        try:
            with torch.cuda.device(device):
                storage = torch.UntypedStorage._new_shared_cuda(
                    device, s["handle"], s["size"], s["offset"], s["ref_counter"],
                    s["ref_counter_offset"], s["event_handle"] or b"",
                    s["event_sync_required"],
                )
                # The open made the current stream wait for the engine's export event;
                # wait on the host too, so the worker's own streams start after it.
                torch.cuda.current_stream(device).synchronize()
        except RuntimeError as e:
            drop_reference(s)
            raise KVCacheError(
                f"cannot open the CUDA IPC handle of storages[{j}] on cuda:{device} (is the "
                "engine alive, and is this another process than the engine?): "
                f"{export_failure(e, allocator_settings(), s['handle'])}"
            ) from e
        opened.append((device, storage))
    tensors = []
    tdtype = layout.torch_dtype()
    for i, (src, off, shape, stride) in enumerate(specs):
        if src >= len(opened):
            raise KVCacheError(f"tensors[{i}] source {src} is not one of {len(opened)} storages")
        device, storage = opened[src]
        end = off + _span_bytes(shape, stride, layout.itemsize)
        if end > storage.nbytes():
            raise KVCacheError(
                f"tensors[{i}] ends at byte {end}, past the {storage.nbytes()} bytes of "
                f"storages[{src}]"
            )
        t = torch.empty(0, dtype=tdtype, device=f"cuda:{device}")
        tensors.append(t.set_(storage, off // layout.itemsize, shape, stride))
    block_views(tensors, layout)
    return tensors


def _as_tuple(tp: type | tuple[type, ...]) -> tuple[type, ...]:
    return tp if isinstance(tp, tuple) else (tp,)


def _local_device(index: int, uuid: str) -> int:
    """This process's index of the engine's GPU: CUDA_VISIBLE_DEVICES may number the
    devices differently in the engine and the worker, the uuid does not lie."""
    import torch

    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    if 0 <= index < torch.cuda.device_count():
        log.warning("GPU %s of the engine not found by uuid; using cuda:%d", uuid, index)
        return index
    raise KVCacheError(f"the engine's GPU {uuid} (cuda:{index} there) is not visible here")
