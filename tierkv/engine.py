"""The engine side of KV-cache registration, and the worker side that opens it.

An inference engine owns its KV cache tensors. To let a gpu worker (another process)
copy blocks between them and the CPU tier, the engine exports them once:

* CUDA tensors by CUDA IPC handle (`KVCache.from_tensors`); the engine keeps the
  tensors alive for as long as the registration is in use.
* CPU tensors live in POSIX shared memory that this module allocates
  (`allocate_kv_cache`); CPU tensors anywhere else cannot be shared and are refused.

`KVCache.registration()` is a plain msgpack-friendly dict that travels engine ->
broker -> worker (`RegisterKVRequest` / `AttachKV`); the worker calls
`open_kv_cache(registration)` and gets an `OpenedKV` of tensors viewing the engine's
memory. An engine restart is a new registration: the worker detaches and closes the
old `OpenedKV` and opens the new one.

The page layout — the bytes of one block inside a CPU-tier page — is defined here
and nowhere else. For a block ``b``, tensor after tensor in `KVLayout.tensor_shapes`
order, the page holds ``tensor.select(block_dim, b)`` in row-major order, seen as
``outer = prod(shape[:block_dim])`` pieces of ``inner = prod(shape[block_dim+1:]) *
itemsize`` bytes (`KVLayout.geometry`). So for `KVLayout.per_layer` a page is
``[L0.K | L0.V | L1.K | L1.V | ...]`` and for `KVLayout.blocks_outer` it is the
block's contiguous slice. `page_size` is the sum over tensors of ``outer * inner``:
the bytes of one rank's block, all layers, K and V.

Import budget: the broker imports this module for `KVLayout`; torch is imported only
inside the functions that build tensors.
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import posix_ipc

from tierkv.shm import RegionError, _check_free_shm, _check_instance, align_up, owner_alive

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tierkv.engine")

REGISTRATION_VERSION = 1

#: dtype name -> bytes per element; the names are torch's attribute names.
DTYPE_SIZES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class KVLayoutError(ValueError):
    """A KV layout that cannot describe a KV cache; the message says which field."""


class KVCacheError(RuntimeError):
    """A KV cache cannot be allocated, exported or opened; the message says why."""


def _positive_int(value: Any, what: str) -> int:
    if type(value) is not int or value <= 0:
        raise KVLayoutError(f"{what} must be a positive integer, got {value!r}")
    return value


# -- the layout ------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """Shapes of the engine's KV cache tensors; every tensor indexes blocks on
    `block_dim`. Validated on construction; msgpack-friendly via `to_dict`."""

    num_blocks: int
    block_size_tokens: int
    dtype: str
    tensor_shapes: tuple[tuple[int, ...], ...]
    block_dim: int

    def __post_init__(self) -> None:
        _positive_int(self.num_blocks, "num_blocks")
        _positive_int(self.block_size_tokens, "block_size_tokens")
        if self.dtype not in DTYPE_SIZES:
            raise KVLayoutError(
                f"dtype {self.dtype!r} is not supported; known: {sorted(DTYPE_SIZES)}"
            )
        if isinstance(self.tensor_shapes, (str, bytes)) or not isinstance(
            self.tensor_shapes, Sequence
        ):
            raise KVLayoutError(
                f"tensor_shapes must be a list of shapes, got {self.tensor_shapes!r}"
            )
        if not self.tensor_shapes:
            raise KVLayoutError("tensor_shapes is empty: a KV cache has at least one tensor")
        if type(self.block_dim) is not int or self.block_dim < 0:
            raise KVLayoutError(f"block_dim must be a non-negative integer, got {self.block_dim!r}")
        shapes = tuple(self._check_shape(i, s) for i, s in enumerate(self.tensor_shapes))
        object.__setattr__(self, "tensor_shapes", shapes)

    def _check_shape(self, i: int, shape: Any) -> tuple[int, ...]:
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape:
            raise KVLayoutError(f"tensor_shapes[{i}] must be a non-empty list, got {shape!r}")
        dims = tuple(_positive_int(d, f"tensor_shapes[{i}] dimension") for d in shape)
        if self.block_dim >= len(dims):
            raise KVLayoutError(
                f"block_dim {self.block_dim} is out of range for tensor_shapes[{i}] {dims}"
            )
        if dims[self.block_dim] != self.num_blocks:
            raise KVLayoutError(
                f"tensor_shapes[{i}] {dims} has {dims[self.block_dim]} blocks on dimension "
                f"{self.block_dim}, expected num_blocks={self.num_blocks}"
            )
        return dims

    # -- the common layouts ---------------------------------------------------------

    @classmethod
    def per_layer(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> KVLayout:
        """One tensor per layer, ``(2, num_blocks, block_size, heads, head_dim)``:
        K and V leading (vLLM's flash-attention layout)."""
        _positive_int(num_layers, "num_layers")
        shape = (2, num_blocks, block_size_tokens, num_kv_heads, head_dim)
        return cls(num_blocks, block_size_tokens, dtype, (shape,) * num_layers, 1)

    @classmethod
    def blocks_outer(
        cls,
        num_blocks: int,
        num_layers: int,
        block_size_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> KVLayout:
        """One contiguous tensor ``(num_blocks, num_layers, 2, block_size, heads,
        head_dim)``: a block is one contiguous slice of every layer."""
        shape = (num_blocks, num_layers, 2, block_size_tokens, num_kv_heads, head_dim)
        return cls(num_blocks, block_size_tokens, dtype, (shape,), 0)

    # -- page geometry --------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def geometry(self, i: int) -> tuple[int, int]:
        """(outer, inner_bytes) of tensor `i`: one block is `outer` pieces of
        `inner_bytes` each (see the module docstring)."""
        shape = self.tensor_shapes[i]
        outer = math.prod(shape[: self.block_dim])
        inner = math.prod(shape[self.block_dim + 1 :]) * self.itemsize
        return outer, inner

    def tensor_block_bytes(self, i: int) -> int:
        outer, inner = self.geometry(i)
        return outer * inner

    @property
    def page_offsets(self) -> list[int]:
        """Byte offset of each tensor's part inside a page."""
        sizes = [self.tensor_block_bytes(i) for i in range(len(self.tensor_shapes))]
        return [0, *itertools.accumulate(sizes)][:-1]

    @property
    def page_size(self) -> int:
        """Bytes of one block across all tensors: one rank's page in the CPU tier."""
        return sum(self.tensor_block_bytes(i) for i in range(len(self.tensor_shapes)))

    def tensor_bytes(self, i: int) -> int:
        return math.prod(self.tensor_shapes[i]) * self.itemsize

    # -- wire form ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "block_size_tokens": self.block_size_tokens,
            "dtype": self.dtype,
            "tensor_shapes": [list(s) for s in self.tensor_shapes],
            "block_dim": self.block_dim,
        }

    @classmethod
    def from_dict(cls, d: Any) -> KVLayout:
        if not isinstance(d, dict):
            raise KVLayoutError(f"a KV layout must be a map, got {type(d).__name__}")
        fields = ("num_blocks", "block_size_tokens", "dtype", "tensor_shapes", "block_dim")
        missing = [f for f in fields if f not in d]
        if missing:
            raise KVLayoutError(f"KV layout is missing {missing}")
        shapes = d["tensor_shapes"]
        if not isinstance(shapes, list) or not all(isinstance(s, list) for s in shapes):
            raise KVLayoutError(f"tensor_shapes must be a list of lists, got {shapes!r}")
        return cls(
            d["num_blocks"], d["block_size_tokens"], d["dtype"],
            tuple(tuple(s) for s in shapes), d["block_dim"],
        )

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


def block_views(tensors: Sequence[torch.Tensor], layout: KVLayout) -> list[torch.Tensor]:
    """Each tensor as bytes shaped ``(outer, num_blocks, inner_bytes)`` (a view, no copy):
    the form every copy path works on. Raises KVCacheError if a tensor's strides do
    not allow it (the block's trailing dimensions must be contiguous)."""
    import torch

    views = []
    for i, t in enumerate(tensors):
        outer, inner = layout.geometry(i)
        try:
            views.append(t.view(torch.uint8).view(outer, layout.num_blocks, inner))
        except RuntimeError as e:
            raise KVCacheError(
                f"KV tensor {i} (shape {tuple(t.shape)}, stride {t.stride()}) cannot be seen "
                f"as ({outer}, {layout.num_blocks}, {inner}) bytes: the dimensions after "
                f"block_dim must be contiguous ({e})"
            ) from e
    return views


def check_tensors(tensors: Sequence[torch.Tensor], layout: KVLayout) -> None:
    """Shapes, dtype and device of `tensors` against `layout`; KVCacheError if not."""
    if len(tensors) != len(layout.tensor_shapes):
        raise KVCacheError(
            f"{len(tensors)} tensors given, the layout has {len(layout.tensor_shapes)}"
        )
    want = layout.torch_dtype()
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise KVCacheError(f"KV tensors are on several devices: {sorted(map(str, devices))}")
    for i, (t, shape) in enumerate(zip(tensors, layout.tensor_shapes, strict=True)):
        if tuple(t.shape) != shape:
            raise KVCacheError(f"KV tensor {i} has shape {tuple(t.shape)}, layout says {shape}")
        if t.dtype != want:
            raise KVCacheError(f"KV tensor {i} has dtype {t.dtype}, layout says {layout.dtype}")
    block_views(tensors, layout)


# -- shared-memory segments (CPU KV caches) ------------------------------------------------

_SEQ = itertools.count()
_NAME_RE = re.compile(r"^/tierkv\.[^/\x00]+\.kv\d+\.(\d+)\.\d+$")
# Live segments allocated by this process, by name. `from_tensors` looks CPU tensors
# up here; weak, so a forgotten cache can still be collected.
_LIVE: weakref.WeakValueDictionary[str, KVCache] = weakref.WeakValueDictionary()
_LIVE_LOCK = threading.Lock()


def kv_segment_name(instance: str, rank: int, pid: int, seq: int) -> str:
    """``/tierkv.<instance>.kv<rank>.<pid>.<seq>``: the pid makes a restarted engine's
    segment never collide with a crashed one's, and lets a sweep find dead owners."""
    return f"/tierkv.{instance}.kv{rank}.{pid}.{seq}"


def _tensor_offsets(layout: KVLayout) -> tuple[list[int], int]:
    """Byte offset of each tensor in a segment (4 KiB aligned) and the segment size."""
    offsets, pos = [], 0
    for i in range(len(layout.tensor_shapes)):
        offsets.append(pos)
        pos = align_up(pos + layout.tensor_bytes(i))
    return offsets, pos


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
        return mmap.mmap(shm.fd, shm.size if size is None else size)
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


# -- the engine side ---------------------------------------------------------------------


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

    storages: list[dict[str, Any]] = []
    index: dict[int, int] = {}
    keep = []
    entries = []
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in index:
            (device, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync) = storage._share_cuda_()
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


# -- the worker side -----------------------------------------------------------------------


class OpenedKV:
    """The engine's KV cache as seen by the worker process: tensors viewing the
    engine's memory. Used by the worker's main thread; `close` must come after the
    transfer engine let go of it (`TransferEngine.attach` of the next one, or close)."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        layout: KVLayout,
        maps: list[tuple[str, mmap.mmap]] | None = None,
        source_pid: int = 0,
    ) -> None:
        self.tensors = tensors
        self.layout = layout
        self.device = tensors[0].device
        self.source_pid = source_pid
        self._maps = maps or []

    @classmethod
    def local(cls, tensors: Sequence[torch.Tensor], layout: KVLayout) -> OpenedKV:
        """Tensors of this very process (in-process engine, tests): no IPC, no copy."""
        tensors = list(tensors)
        check_tensors(tensors, layout)
        return cls(tensors, layout, source_pid=os.getpid())

    @property
    def closed(self) -> bool:
        return not self.tensors

    def block_views(self) -> list[torch.Tensor]:
        return block_views(self.tensors, self.layout)

    def close(self) -> None:
        """Release the tensor views, then unmap (CUDA: the IPC mappings close when
        the last view dies). Idempotent."""
        self.tensors = []
        maps, self._maps = self._maps, []
        for name, mm in maps:
            _close_map(mm, name)

    def __enter__(self) -> OpenedKV:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OpenedKV({self.device}, {len(self.layout.tensor_shapes)} tensors)"


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
        tensors = []
        for i, (src, off, shape, stride) in enumerate(specs):
            if src >= len(maps):
                raise KVCacheError(f"tensors[{i}] source {src} is not one of {len(maps)} segments")
            name, mm = maps[src]
            end = off + _span_bytes(shape, stride, layout.itemsize)
            if end > mm.size():
                raise KVCacheError(
                    f"tensors[{i}] ends at byte {end}, past the {mm.size()} bytes of {name}"
                )
            tensors += _tensors_on_buffer(mm, [(off, shape, stride)], layout.dtype)
        block_views(tensors, layout)
    except BaseException:
        tensors = []
        for name, mm in maps:
            _close_map(mm, name)
        raise
    return OpenedKV(tensors, layout, maps, pid if type(pid) is int else 0)


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
            raise KVCacheError(
                f"cannot open the CUDA IPC handle of storages[{j}] on cuda:{device} "
                f"(is the engine alive, and is this another process than the engine?): {e}"
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
