"""One SGLang host-pool page in one row of the node's CPU tier, and its check.

A page of SGLang's host KV pool is a list of pieces (host pointer, bytes): two per
page in the page-first layouts (K and V of every layer), two per layer in
`layer_first`, one or two per layer for MLA. `get_page_buffer_meta` gives them.
In the CPU tier the pieces lie end to end, followed by a check of 32 bytes:

    [ piece 0 ][ piece 1 ] ... [ piece n-1 ][ magic | payload bytes | key sum | payload sum ]

The payload sum is seeded with the key's, so a row that holds another key's bytes
(a row reused after a broker restart, a block swapped on disk) fails the check as
surely as a flipped bit: a read that fails it is a miss, never wrong bytes. The
node verifies blocks it promotes from disk or S3 (`tierkv.core.blockformat`); this
check also covers the shared region itself, which any process of the host can map.

Copies are `ctypes.memmove` between the host pool's pointers and the mapped region:
the GIL is let go during each copy, and no byte crosses a socket.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

CHECK_MAGIC = b"TKVSGL\x00\x01"
_CHECK = struct.Struct("<8sQQQ")  # magic, payload bytes, key sum, payload sum
CHECK_BYTES = _CHECK.size

Pieces = Sequence[tuple[int, int]]  # (host address, bytes) of one page, in order


class PageMismatch(ValueError):
    """The node's CPU pages are not the size this SGLang pool's pages need."""


def split_pages(pointers: Sequence[int], sizes: Sequence[int], pages: int) -> list[Pieces]:
    """`get_page_buffer_meta`'s flat lists, cut into the pieces of each page."""
    if pages <= 0 or len(pointers) != len(sizes) or len(pointers) % pages:
        raise ValueError(f"{len(pointers)} pointers and {len(sizes)} sizes do not make "
                         f"{pages} pages of equal pieces")
    per = len(pointers) // pages
    pairs = list(zip(map(int, pointers), map(int, sizes), strict=True))
    return [pairs[i * per:(i + 1) * per] for i in range(pages)]


def payload_bytes(pieces: Pieces) -> int:
    return sum(size for _, size in pieces)


def node_page_bytes(payload: int) -> int:
    """The `cpu.page_size` a node needs for pages of `payload` bytes."""
    return payload + CHECK_BYTES


def model_page_payload(page_tokens: int, layers: int, dtype_bytes: int, kv_heads: int = 0,
                       head_dim: int = 0, mla_dims: int = 0) -> int:
    """The bytes of one SGLang host page of a model at TP 1, from its shape (before a
    node exists to ask): K and V of every KV head per token and layer, or for MLA
    the one latent vector (`kv_lora_rank + qk_rope_head_dim`, `mla_dims`)."""
    per_token = mla_dims if mla_dims else 2 * kv_heads * head_dim
    if min(page_tokens, layers, dtype_bytes, per_token) <= 0:
        raise ValueError("a page needs tokens, layers, a dtype and heads (or MLA dims)")
    return page_tokens * layers * per_token * dtype_bytes


def check_page_size(payload: int, node_page: int) -> None:
    """Raise PageMismatch, saying the size to configure, unless they fit exactly."""
    want = node_page_bytes(payload)
    if node_page != want:
        raise PageMismatch(
            f"the tierkv node's CPU tier has pages of {node_page} bytes, but this SGLang "
            f"host pool's pages are {payload} bytes (+{CHECK_BYTES} bytes of check): set "
            f"cpu.page_size = {want} in the node's config (and size its tiers for it)")


def key_sum(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key)


@dataclass(frozen=True, slots=True)
class RowView:
    """The address of one row's first page in a mapped region (valid while mapped)."""

    address: int
    page_bytes: int

    @classmethod
    def of(cls, rows: np.ndarray, row: int, page_bytes: int) -> RowView:
        """`rows`: the region's (num_blocks, row_stride) uint8 array."""
        return cls(int(rows[row].ctypes.data), page_bytes)

    def memory(self) -> memoryview:
        """The page's bytes as memory (what the check sums)."""
        buf = (ctypes.c_char * self.page_bytes).from_address(self.address)
        return memoryview(buf).cast("B")


def write_page(row: RowView, key: bytes, pieces: Pieces) -> None:
    """Copy a host page into the row, then its check."""
    offset = 0
    for address, size in pieces:
        ctypes.memmove(row.address + offset, address, size)
        offset += size
    page = row.memory()
    total = _CHECK.pack(CHECK_MAGIC, offset, key_sum(key),
                        xxhash.xxh3_64_intdigest(page[:offset], key_sum(key)))
    ctypes.memmove(row.address + offset, total, CHECK_BYTES)


def page_intact(row: RowView, key: bytes, payload: int) -> bool:
    """Whether the row holds `key`'s page of `payload` bytes, whole and unchanged."""
    page = row.memory()
    magic, length, ksum, psum = _CHECK.unpack(
        ctypes.string_at(row.address + payload, CHECK_BYTES))
    if magic != CHECK_MAGIC or length != payload or ksum != key_sum(key):
        return False
    return xxhash.xxh3_64_intdigest(page[:payload], ksum) == psum


def read_page(row: RowView, pieces: Pieces) -> None:
    """Copy a (verified) row into a host page."""
    offset = 0
    for address, size in pieces:
        ctypes.memmove(address, row.address + offset, size)
        offset += size
