"""vLLM's real scheduler and connector weighing promotions against recomputing: the
engine says its prefill rate with every lookup, and the node promotes from a tier
only what is expected to arrive sooner than the engine could compute it."""

from __future__ import annotations

from tests.vllm.conftest import SHAPE, extra_config
from tests.vllm.test_connector import documents, node_stats, serve_rounds
from tierkv.bench.vllm_engine import Engine
from tierkv.bench.vllm_setup import STAND_IN_PREFILL_TPS


def disk_node(start_node, tmp_path, **cost):
    """32 CPU rows in front of a disk tier whose promotion cost starts at `cost`."""
    root = tmp_path / "disk"
    root.mkdir()
    return start_node(cpu_blocks=32, disk_blocks=0, tiers=[
        {"type": "disk", "root": str(root), "budget_bytes": 1024 * SHAPE.page_size, **cost}])


def test_a_tier_slower_than_the_engine_is_not_waited_for(start_node, tmp_path):
    # 8 documents x 12 blocks: more than the GPU and the CPU tier hold, so later
    # rounds find most of them only on disk, assumed to take a minute a promotion.
    node = disk_node(start_node, tmp_path, load_latency_ms=60_000.0)
    # The engine computes at a GPU's rate (an 8B model on an H100).
    engine = serve_rounds(Engine(SHAPE, extra_config(
        node, prefill_tokens_per_s=STAND_IN_PREFILL_TPS)), documents(8))
    assert engine.mismatches == []
    stats = node_stats(node)
    assert stats["tiers"]["disk"]["slower_than_recompute"] > 0
    assert stats["tiering"]["promotions_overrun"] == 0


def test_an_engine_slower_than_the_tier_is_served_from_it(start_node, tmp_path):
    node = disk_node(start_node, tmp_path, load_latency_ms=60_000.0)
    # 1 token/s: recomputing a block takes 16 s, so a run of four blocks is worth even
    # a minute-long promotion, and once the tier is measured, every run is.
    engine = serve_rounds(Engine(SHAPE, extra_config(node, prefill_tokens_per_s=1.0)),
                          documents(8))
    assert engine.mismatches == []
    stats = node_stats(node)
    assert stats["tiering"]["promotions_landed"] > 0
    assert engine.tokens["external_hits"] >= 4 * 12 * SHAPE.block_size
    cost = stats["tiers"]["disk"]["load_cost"]
    assert cost["samples"] > 0 and cost["latency_ms"] < 60_000.0  # learned: faster


def test_the_rule_turned_off_loads_whatever_it_costs(start_node, tmp_path):
    node = disk_node(start_node, tmp_path, load_latency_ms=60_000.0)
    engine = serve_rounds(Engine(SHAPE, extra_config(node, prefill_tokens_per_s=0.0)),
                          documents(8))
    assert engine.mismatches == []
    stats = node_stats(node)
    assert stats["tiering"]["promotions_landed"] > 0
    assert stats["tiers"]["disk"]["slower_than_recompute"] == 0
