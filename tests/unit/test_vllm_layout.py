"""How vLLM's chunks map onto tierkv blocks (`tierkv.vllm.layout`): pure logic, no vLLM."""

from __future__ import annotations

import pytest

from tierkv.vllm.layout import KeyMap, NodeMismatch, check_node, namespace, pair_blocks


def test_a_chunk_is_one_tierkv_key_under_the_engines_namespace():
    keymap = KeyMap(b"ns")
    assert keymap.key(b"k") == b"nsk"
    assert keymap.keys([b"a", b"b"]) == [b"nsa", b"nsb"]
    # Events name this namespace's chunks only.
    assert keymap.chunk_of(b"nsk") == b"k" and keymap.chunk_of(b"xxk") is None


def test_a_key_too_long_for_tierkv_is_refused():
    with pytest.raises(ValueError, match="too long"):
        KeyMap(b"n" * 8).key(b"k" * 57)


def test_equal_facts_give_equal_namespaces():
    assert namespace("m", "bf16", 16) == namespace("m", "bf16", 16)
    assert namespace("m", "bf16", 16) != namespace("m", "fp8", 16)
    assert len(namespace("m")) == 8


def test_a_gpu_block_goes_to_its_chunks_row_at_its_place_in_the_chunk():
    # Group 0: GPU blocks 10, 11, 12 from request block 3 with chunks of 2 blocks: the
    # second half of chunk 1 (row 100) and all of chunk 2 (row 101). Group 1: one GPU
    # block (20) at request block 0, chunk 0 (row 200).
    pairs = pair_blocks([10, 11, 12, 20], group_sizes=[3, 1], block_indices=[3, 0],
                        rows=[100, 101, 200], chunks_per_group=[2, 1], blocks_per_chunk=2)
    assert (pairs.gpu, pairs.rows, pairs.page, pairs.missing) == (
        [10, 11, 12, 20], [100, 101, 101, 200], [1, 0, 1, 0], 0)
    pairs = pair_blocks([5, 6], [2], [0], [-1], [1], 2)  # no row: nothing to copy
    assert (pairs.gpu, pairs.missing) == ([], 2)


@pytest.mark.parametrize("args, error", [
    (([1, 2], [1], [0], [5], [1], 1), "group sizes add up to 1"),
    (([1], [1], [0], [5, 6], [1], 1), "2 rows for 1 chunks"),
    (([1, 2, 3], [3], [0], [5], [1], 2), "span 2 chunks, 1 given"),
    (([1], [1, 0], [0], [5], [1], 1), "2 group sizes, 1 block indices"),
])
def test_sides_that_disagree_are_refused(args, error):
    with pytest.raises(ValueError, match=error):
        pair_blocks(*args)


def test_a_node_that_does_not_fit_names_what_to_set():
    check_node(4096, 2, 4096, 2, "n")
    with pytest.raises(NodeMismatch, match="cpu.page_size=8192 .* cpu.world_size=2 .*"
                       "world size x GPU blocks per offloaded chunk"):
        check_node(4096, 1, 8192, 2, "n")
