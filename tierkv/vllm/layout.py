"""How vLLM's offloading model maps onto a tierkv node: keys, rows and pages.

vLLM offloads *chunks*: an `OffloadKey` (block hash + 4-byte KV-cache group index)
names `blocks_per_chunk` consecutive GPU blocks of one group. A chunk is one tierkv
block, keyed ``namespace + vLLM key``, in one CPU-tier row: the row holds a page per
GPU block of the chunk on every rank (`cpu.page_size` = one rank's bytes of a GPU
block, all KV tensors; `cpu.world_size` = vLLM's world size x `blocks_per_chunk`;
block j of the chunk on rank r is page ``r * blocks_per_chunk + j``). So a chunk is
stored, found, pinned and evicted as a whole: never half of it a hit. The namespace
(`identity.py`) keeps engines of different models or layouts apart on one node, and
is the same for every engine of one model and layout: their prefixes are each
other's hits.

Copying every KV tensor of a GPU block is right for every group: vLLM hands a block
id to one group at a time, so all tensors' pages of that block belong to it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tierkv.core.keys import MAX_KEY_LEN

NAMESPACE_BYTES = 8


class NodeMismatch(ValueError):
    """The node's CPU tier cannot hold this engine's blocks; the message says what to
    set in the node's config."""


def namespace(*facts: object) -> bytes:
    """A short, stable prefix from what makes blocks interchangeable (model, dtype,
    block geometry, parallel layout): equal facts, equal namespace."""
    text = "\x1f".join(str(f) for f in facts)
    return hashlib.blake2b(text.encode(), digest_size=NAMESPACE_BYTES).digest()


@dataclass(frozen=True, slots=True)
class KeyMap:
    """vLLM chunk keys <-> tierkv keys (one per chunk) under one namespace."""

    prefix: bytes

    def key(self, chunk: bytes) -> bytes:
        key = self.prefix + chunk
        if len(key) > MAX_KEY_LEN:
            raise ValueError(f"a vLLM key of {len(chunk)} bytes is too long for tierkv "
                             f"(at most {MAX_KEY_LEN - len(self.prefix)})")
        return key

    def keys(self, chunks: Iterable[bytes]) -> list[bytes]:
        prefix = self.prefix
        keys = [prefix + c for c in chunks]
        if keys and max(map(len, keys)) > MAX_KEY_LEN:
            self.key(max(keys, key=len))  # raises, naming the length
        return keys

    def chunk_of(self, key: bytes) -> bytes | None:
        """The vLLM key a tierkv key names (None: not this namespace's)."""
        return key[len(self.prefix):] if key.startswith(self.prefix) else None


def check_node(page_size: int, world_size: int, want_page: int, want_world: int,
               instance: str) -> None:
    """The node's CPU tier must hold exactly one chunk per row: a page per GPU block
    of the chunk on every rank (`want_world` = vLLM's world size x blocks per chunk)."""
    if page_size != want_page or world_size != want_world:
        raise NodeMismatch(
            f"tierkv node {instance!r} has cpu.page_size={page_size}, "
            f"cpu.world_size={world_size}; this vLLM engine needs cpu.page_size="
            f"{want_page} (one GPU block of one rank, every KV tensor) and "
            f"cpu.world_size={want_world} (vLLM's world size x GPU blocks per offloaded "
            f"chunk): set them in the node's config and restart it"
        )


@dataclass(slots=True)
class Pairs:
    """One job's copies: GPU block `gpu[i]` <-> page `page[i]` (its index in its
    chunk) of row `rows[i]`."""

    gpu: list[int]
    rows: list[int]
    page: list[int]
    missing: int  # GPU blocks whose chunk has no row (-1)


def pair_blocks(
    gpu_block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    rows: Sequence[int],
    chunks_per_group: Sequence[int],
    blocks_per_chunk: int,
) -> Pairs:
    """Each GPU block of a job with its chunk's row and its page in the row.

    Group after group, a group's GPU blocks are consecutive blocks of the request
    from its `block_indices` entry on, and its chunks are consecutive too (vLLM's
    contract for every offloading back end): the first block may sit inside its
    chunk. `rows` holds one row per chunk in the same order; a row of -1 (nothing to
    write: present already; or no row) drops its blocks. Raises ValueError if the
    two sides disagree."""
    if not len(group_sizes) == len(block_indices) == len(chunks_per_group):
        raise ValueError(f"{len(group_sizes)} group sizes, {len(block_indices)} block "
                         f"indices, {len(chunks_per_group)} chunk counts")
    if sum(group_sizes) != len(gpu_block_ids):
        raise ValueError(f"group sizes add up to {sum(group_sizes)}, "
                         f"{len(gpu_block_ids)} GPU blocks given")
    if sum(chunks_per_group) != len(rows):
        raise ValueError(f"{len(rows)} rows for {sum(chunks_per_group)} chunks")
    out = Pairs([], [], [], 0)
    gpu_at = chunk_at = 0
    for size, first, chunks in zip(group_sizes, block_indices, chunks_per_group,
                                   strict=True):
        skip = first % blocks_per_chunk
        if size and -(-(skip + size) // blocks_per_chunk) != chunks:
            raise ValueError(f"{size} GPU blocks from block {first} span "
                             f"{-(-(skip + size) // blocks_per_chunk)} chunks, "
                             f"{chunks} given")
        for j in range(size):
            chunk, page = divmod(skip + j, blocks_per_chunk)
            row = rows[chunk_at + chunk]
            if row < 0:
                out.missing += 1
            else:
                out.gpu.append(gpu_block_ids[gpu_at + j])
                out.rows.append(row)
                out.page.append(page)
        gpu_at += size
        chunk_at += chunks
    return out
