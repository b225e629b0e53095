"""How vLLM's offloading model maps onto a tierkv node: keys, rows and pages.

vLLM offloads *chunks*: an `OffloadKey` (block hash + 4-byte KV-cache group index)
names `blocks_per_chunk` consecutive GPU blocks of one group. A tierkv CPU-tier row
holds one GPU block of every rank (`cpu.page_size` = one rank's bytes of a GPU block,
all KV tensors; `cpu.world_size` = vLLM's world size), so a chunk is
`blocks_per_chunk` tierkv blocks, keyed ``namespace + vLLM key (+ one byte: the
block's index in the chunk, when a chunk has more than one)``. The namespace keeps
engines of different models or layouts apart on one node, and is the same for every
engine of one model and layout: their prefixes are each other's hits.

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
    """vLLM chunk keys <-> tierkv block keys."""

    prefix: bytes
    blocks_per_chunk: int

    def blocks(self, key: bytes) -> list[bytes]:
        """The tierkv keys of one chunk, in block order."""
        base = self.prefix + key
        if len(base) + (self.blocks_per_chunk > 1) > MAX_KEY_LEN:
            raise ValueError(f"a vLLM key of {len(key)} bytes is too long for tierkv "
                             f"(at most {MAX_KEY_LEN - len(self.prefix) - 1})")
        if self.blocks_per_chunk == 1:
            return [base]
        return [base + bytes([i]) for i in range(self.blocks_per_chunk)]

    def all_blocks(self, keys: Iterable[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for key in keys:
            out.extend(self.blocks(key))
        return out

    def chunk_of(self, block_key: bytes) -> bytes | None:
        """The vLLM key a tierkv key belongs to (None: not this engine's namespace, or
        not the chunk's first block, so each chunk is reported once)."""
        if not block_key.startswith(self.prefix):
            return None
        key = block_key[len(self.prefix):]
        if self.blocks_per_chunk == 1:
            return key
        return key[:-1] if key[-1] == 0 else None


def check_node(page_size: int, world_size: int, want_page: int, want_world: int,
               instance: str) -> None:
    """The node's CPU tier must hold exactly one GPU block of every rank per row."""
    if page_size != want_page or world_size != want_world:
        raise NodeMismatch(
            f"tierkv node {instance!r} has cpu.page_size={page_size}, "
            f"cpu.world_size={world_size}; this vLLM engine needs cpu.page_size="
            f"{want_page} (one GPU block of one rank, every KV tensor) and "
            f"cpu.world_size={want_world}: set them in the node's config and restart it"
        )


def pair_blocks(
    gpu_block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    rows: Sequence[int],
    chunks_per_group: Sequence[int],
    blocks_per_chunk: int,
) -> tuple[list[int], list[int], int]:
    """(GPU block ids, CPU rows, blocks without a row) for one job.

    Group after group, a group's GPU blocks are consecutive blocks of the request
    from its `block_indices` entry on, and its chunks are consecutive too (vLLM's
    contract for every offloading back end); `rows` holds `blocks_per_chunk` rows
    per chunk in the same order. A row of -1 (nothing to write: present already,
    or no room) drops its block. Raises ValueError if the two sides disagree."""
    if not len(group_sizes) == len(block_indices) == len(chunks_per_group):
        raise ValueError(f"{len(group_sizes)} group sizes, {len(block_indices)} block "
                         f"indices, {len(chunks_per_group)} chunk counts")
    if sum(group_sizes) != len(gpu_block_ids):
        raise ValueError(f"group sizes add up to {sum(group_sizes)}, "
                         f"{len(gpu_block_ids)} GPU blocks given")
    if sum(chunks_per_group) * blocks_per_chunk != len(rows):
        raise ValueError(f"{len(rows)} rows for {sum(chunks_per_group)} chunks of "
                         f"{blocks_per_chunk} blocks")
    gpu_out: list[int] = []
    rows_out: list[int] = []
    missing = 0
    gpu_at = row_at = 0
    for size, first, chunks in zip(group_sizes, block_indices, chunks_per_group,
                                   strict=True):
        skip = first % blocks_per_chunk
        if size and -(-(skip + size) // blocks_per_chunk) != chunks:
            raise ValueError(f"{size} GPU blocks from block {first} span "
                             f"{-(-(skip + size) // blocks_per_chunk)} chunks, "
                             f"{chunks} given")
        for j in range(size):
            row = rows[row_at + skip + j]
            if row < 0:
                missing += 1
            else:
                gpu_out.append(gpu_block_ids[gpu_at + j])
                rows_out.append(row)
        gpu_at += size
        row_at += chunks * blocks_per_chunk
    return gpu_out, rows_out, missing
