"""How vLLM's chunks map onto tierkv blocks (`tierkv.vllm.layout`): pure logic, no vLLM."""

from __future__ import annotations

import pytest

from tierkv.vllm.layout import KeyMap, NodeMismatch, check_node, namespace, pair_blocks


def test_a_chunk_is_one_block_per_gpu_block_under_the_engines_namespace():
    one, two = KeyMap(b"ns", 1), KeyMap(b"ns", 2)
    assert one.blocks(b"k") == [b"nsk"]
    assert two.blocks(b"k") == [b"nsk\x00", b"nsk\x01"]
    assert two.all_blocks([b"a", b"b"]) == [b"nsa\x00", b"nsa\x01", b"nsb\x00", b"nsb\x01"]
    # Events name each chunk once (its first block), and only this namespace's.
    assert [two.chunk_of(k) for k in two.blocks(b"k")] == [b"k", None]
    assert one.chunk_of(b"nsk") == b"k" and one.chunk_of(b"xxk") is None


def test_a_key_too_long_for_tierkv_is_refused():
    with pytest.raises(ValueError, match="too long"):
        KeyMap(b"n" * 8, 2).blocks(b"k" * 56)


def test_equal_facts_give_equal_namespaces():
    assert namespace("m", "bf16", 16) == namespace("m", "bf16", 16)
    assert namespace("m", "bf16", 16) != namespace("m", "fp8", 16)
    assert len(namespace("m")) == 8


def test_pairs_follow_each_groups_block_index_and_skip_rows_without_a_block():
    # Group 0: GPU blocks 10, 11, 12 from request block 3 with chunks of 2 blocks, so
    # they sit at [1] of chunk 1 and [0], [1] of chunk 2 (rows 100..103 for chunks
    # 1-2). Group 1: one GPU block (20) at request block 0, chunk 0 (rows 200, 201).
    gpu, rows, missing = pair_blocks(
        [10, 11, 12, 20], group_sizes=[3, 1], block_indices=[3, 0],
        rows=[100, 101, 102, 103, 200, -1], chunks_per_group=[2, 1], blocks_per_chunk=2)
    assert (gpu, rows, missing) == ([10, 11, 12, 20], [101, 102, 103, 200], 0)
    gpu, rows, missing = pair_blocks([5, 6], [2], [0], [-1, 7], [1], 2)
    assert (gpu, rows, missing) == ([6], [7], 1)


@pytest.mark.parametrize("args, error", [
    (([1, 2], [1], [0], [5], [1], 1), "group sizes add up to 1"),
    (([1], [1], [0], [5, 6], [1], 1), "2 rows for 1 chunks"),
    (([1, 2, 3], [3], [0], [5, 6], [1], 2), "span 2 chunks, 1 given"),
    (([1], [1, 0], [0], [5], [1], 1), "2 group sizes, 1 block indices"),
])
def test_sides_that_disagree_are_refused(args, error):
    with pytest.raises(ValueError, match=error):
        pair_blocks(*args)


def test_a_node_that_does_not_fit_names_what_to_set():
    check_node(4096, 2, 4096, 2, "n")
    with pytest.raises(NodeMismatch, match="cpu.page_size=8192 .* cpu.world_size=2"):
        check_node(4096, 1, 8192, 2, "n")
