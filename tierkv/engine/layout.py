"""The layout of an engine's KV cache, and the page layout it defines.

The page layout — the bytes of one block inside a CPU-tier page — is defined here
and nowhere else. For a block ``b``, tensor after tensor in `KVLayout.tensor_shapes`
order, the page holds ``tensor.select(block_dim, b)`` in row-major order, seen as
``outer = prod(shape[:block_dim])`` pieces of ``inner = prod(shape[block_dim+1:]) *
itemsize`` bytes (`KVLayout.geometry`). So for `KVLayout.per_layer` a page is
``[L0.K | L0.V | L1.K | L1.V | ...]`` and for `KVLayout.blocks_outer` it is the
block's contiguous slice. `page_size` is the sum over tensors of ``outer * inner``:
the bytes of one rank's block, all layers, K and V.

Import budget: the broker imports this module for `KVLayout`; torch is imported only
inside the functions that look at tensors.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

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


def byte_block_views(arrays: Sequence[np.ndarray], layout: KVLayout) -> list[np.ndarray]:
    """`block_views` of the byte arrays `_open_cpu` maps (each tensor's elements as
    bytes, the last dimension ``itemsize`` times longer), in numpy: a CPU worker
    copies with numpy and so never imports torch (seconds at every start)."""
    views = []
    for i, a in enumerate(arrays):
        outer, inner = layout.geometry(i)
        shape = (outer, layout.num_blocks, inner)
        try:
            views.append(_reshaped_in_place(a, shape))
        except (ValueError, AttributeError) as e:
            raise KVCacheError(
                f"KV tensor {i} (byte strides {a.strides}) cannot be seen as {shape} bytes: "
                f"the dimensions after block_dim must be contiguous ({e})") from e
    return views


def _reshaped_in_place(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`a` seen with `shape`, never a copy (a copy of a KV cache is gigabytes)."""
    try:
        return a.reshape(shape, copy=False)
    except TypeError:  # numpy < 2.1: setting the shape refuses what needs a copy
        view = a.view()
        view.shape = shape
        return view


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

