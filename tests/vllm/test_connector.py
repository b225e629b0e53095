"""vLLM 0.33's real Scheduler and OffloadingConnector (both roles) on CPU KV tensors,
offloading into a real tierkv node (broker and disk tier processes).

Every engine step the stand-in model checks that each block vLLM counts as computed
holds the bytes of its own hash (`Engine.mismatches`), so a load that delivers the
wrong bytes — from the CPU tier, or promoted back from disk — fails these tests.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tests.vllm.conftest import SHAPE
from tierkv.bench.vllm_engine import Engine
from tierkv.bench.vllm_engine import tierkv_extra_config as extra_config
from tierkv.client import Client
from tierkv.core.shm import RegionError, SharedRegion
from tierkv.vllm.layout import NodeMismatch

DOC_BLOCKS = 12  # a shared prefix: 12 GPU blocks of 16 tokens


def documents(n: int, start: int = 0) -> list[list[int]]:
    return [[100 + (start + d) * 1000 + i for i in range(DOC_BLOCKS * SHAPE.block_size)]
            for d in range(n)]


def run_round(engine: Engine, docs: list[list[int]], tag: int) -> None:
    """Every document once, each with its own short suffix, to the end."""
    for doc in docs:
        engine.add(doc + [7, 8, tag], max_tokens=2)
    engine.run()


def serve_rounds(engine: Engine, docs: list[list[int]], rounds: int = 3) -> Engine:
    """Every document `rounds` times, then the engine closed; returns it to check."""
    try:
        for tag in range(rounds):
            run_round(engine, docs, tag)
    finally:
        engine.close()
    return engine


def node_stats(node) -> dict:
    with Client.from_config(node.config) as c:
        return c.stats()


def test_kv_is_stored_evicted_to_disk_promoted_and_loaded_back_byte_exact(start_node):
    # 8 documents x 12 blocks = 96 blocks: more than the GPU (48) and the CPU tier
    # (32) hold, so later rounds are served by the CPU tier and by promotions from disk.
    node = start_node(cpu_blocks=32)
    engine = serve_rounds(Engine(SHAPE, extra_config(node)),
                          documents(8))
    assert engine.mismatches == []
    assert engine.tokens["external_hits"] >= 4 * DOC_BLOCKS * SHAPE.block_size
    stats = node_stats(node)
    assert stats["tiering"]["promotions_landed"] > 0  # some hits came back from disk
    assert stats["tiering"]["promotions_failed"] == 0


def test_the_byte_check_catches_a_corrupted_cpu_tier(start_node, instance):
    """The negative control of the check above: the same run with the CPU tier's
    bytes overwritten between rounds reports mismatches."""
    node = start_node(cpu_blocks=64)
    engine = Engine(SHAPE, extra_config(node))
    try:
        docs = documents(6)
        run_round(engine, docs, 0)
        with SharedRegion.attach(instance) as region:
            np.asarray(region.numpy())[:] = 0x5A
        run_round(engine, docs, 1)
    finally:
        engine.close()
    assert engine.tokens["external_hits"] > 0
    assert engine.mismatches


def two_engines_one_after_the_other(node: Any, **options: Any) -> tuple[Engine, Engine]:
    """Two engines on one node, the second serving the documents the first computed;
    neither ever read a wrong byte."""
    first = Engine(SHAPE, extra_config(node, **options), name="a")
    second = Engine(SHAPE, extra_config(node, **options), name="b")
    try:
        docs = documents(4)
        run_round(first, docs, 0)
        run_round(second, docs, 1)
    finally:
        first.close()
        second.close()
    assert first.mismatches == [] and second.mismatches == []
    return first, second


def test_two_engines_share_one_node(start_node):
    """A prefix one engine stored is a hit for another engine on the same node (vLLM's
    own offloading keeps each engine's CPU cache to itself)."""
    first, second = two_engines_one_after_the_other(start_node(cpu_blocks=128))
    assert first.tokens["external_hits"] == 0
    # Every full block of every document but the GPU-cached tail was served by tierkv.
    assert second.tokens["external_hits"] >= 4 * (DOC_BLOCKS - 1) * SHAPE.block_size


def test_a_tier_killed_mid_run_costs_hits_never_correctness(start_node):
    node = start_node(cpu_blocks=32)
    engine = Engine(SHAPE, extra_config(node))
    try:
        docs = documents(8)
        run_round(engine, docs, 0)
        for doc in docs:
            engine.add(doc + [7, 8, 1], max_tokens=2)
        for _ in range(3):  # lookups started promotions from disk
            engine.step()
        assert node_stats(node)["tiering"]["promotions_started"] > 0
        node.kill("tier:disk:0")
        engine.run(timeout_s=60)
        run_round(engine, docs, 2)
    finally:
        engine.close()
    assert engine.mismatches == []
    assert not engine.scheduler.has_unfinished_requests()


def test_a_broker_that_is_gone_means_recompute_not_a_hang(start_node):
    node = start_node(cpu_blocks=64)
    engine = Engine(SHAPE, extra_config(node, timeout_s=0.5))
    try:
        docs = documents(4)
        run_round(engine, docs, 0)
        node.kill("broker")
        run_round(engine, docs, 1)  # bounded: each request waits one timeout at most
    finally:
        engine.close()
    assert engine.mismatches == []
    assert not engine.scheduler.has_unfinished_requests()


def test_a_node_that_does_not_fit_the_engine_is_refused_naming_the_setting(start_node):
    node = start_node(page_size=SHAPE.page_size // 2)
    with pytest.raises(NodeMismatch, match=f"cpu.page_size={SHAPE.page_size}"):
        Engine(SHAPE, extra_config(node))


def test_an_engine_without_a_node_says_so(tmp_path):
    config = {"spec_name": "TierkvOffloadingSpec", "spec_module_path": "tierkv.vllm",
              "tierkv_instance": "tnonode", "tierkv_address": f"ipc://{tmp_path}/c.sock"}
    with pytest.raises(RegionError, match="is the broker of instance 'tnonode' running"):
        Engine(SHAPE, config)


def test_chunks_of_two_gpu_blocks_are_stored_and_loaded_byte_exact(start_node):
    """vLLM's `block_size` of 32 tokens: an offloaded chunk is two 16-token GPU blocks,
    two tierkv blocks; partial chunks at a request's edges are skipped or split."""
    node = start_node(cpu_blocks=64)
    engine = serve_rounds(Engine(SHAPE, extra_config(node, block_size=2 * SHAPE.block_size)),
                          documents(6))
    assert engine.mismatches == []
    assert engine.tokens["external_hits"] >= 2 * DOC_BLOCKS * SHAPE.block_size


def test_every_lookup_can_wait_for_the_end_of_step_round_trip(start_node):
    """`sync_lookups` 0: no lookup has a round trip of its own; each request is told
    RETRY once and served from the end-of-step answers."""
    first, second = two_engines_one_after_the_other(start_node(cpu_blocks=128),
                                                    sync_lookups=0)
    assert second.tokens["external_hits"] >= 4 * (DOC_BLOCKS - 1) * SHAPE.block_size


def test_a_hybrid_model_offloads_both_kv_cache_groups(start_node):
    """Full-attention and sliding-window layers in two KV-cache groups: vLLM's keys of
    both groups are tierkv blocks, its sliding-window lookups use the per-key status,
    and every block of both groups is checked."""
    shape = replace(SHAPE, gpu_blocks=64, sliding_window=4 * SHAPE.block_size)
    node = start_node(cpu_blocks=64)
    engine = serve_rounds(Engine(shape, extra_config(node)),
                          documents(6))
    assert engine.mismatches == []
    assert engine.tokens["external_hits"] >= 4 * DOC_BLOCKS * SHAPE.block_size
