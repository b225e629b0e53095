"""A node whose CPU tier is smaller than the working set, so that reuse is served
from disk by promotion: how often a block is promoted, and faults mid-run (the disk
tier SIGKILLed, the broker SIGKILLed) cost hits, never correctness, and never hang."""

from __future__ import annotations

import pytest

from tests.conftest import new_instance
from tests.engine.harness import (
    MAX_TOKENS,
    RUN_S,
    describe,
    engine_config,
    hits,
    identical,
    managed_node,
    node_delta,
)
from tierkv.demo.vllm_workload import chats, documents, mixed

CPU_BLOCKS = 32
# 8 documents of 8 blocks, 2 questions each, and 6 conversations of 4 turns: about
# 105 distinct blocks, against 32 in the CPU tier and 40 in the engine's own cache.
WORKLOAD = mixed(documents(8, 8, 2, seed=11), chats(6, 4, seed=11, tag="f"))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    yield from managed_node(new_instance(), tmp_path_factory.mktemp("faults"),
                            cpu_blocks=CPU_BLOCKS, disk_blocks=1024)


@pytest.fixture(scope="module")
def engine(node, engines, references):
    # A broker that does not answer in 0.5 s is taken for gone (recompute, no hang).
    return engines.start(engine_config(references.model("A"), "A", node, timeout_s=0.5),
                         "faults")


def run(engine, node, on_round=None):
    before = node.stats()
    result = engine.run(WORKLOAD, MAX_TOKENS, reset_device_cache=True, timeout_s=RUN_S,
                        on_round=on_round)
    engine.settle()
    return result, before


def test_promotions_per_distinct_block(node, engine, references, say):
    reference = references.outputs(WORKLOAD)
    first, _ = run(engine, node)
    second, before = run(engine, node)
    after = node.stats()
    delta = node_delta(before, after)
    distinct = after["tiers"]["disk"]["blocks"]
    tiering = {k: after["tiering"][k] - before["tiering"][k]
               for k in ("promotions_started", "promotions_landed", "promotions_failed",
                         "promotions_refused", "promotions_cancelled")}
    say(describe("smaller CPU tier, first pass", first, reference))
    say(describe("smaller CPU tier, second pass", second, reference, delta))
    say(f"promotions: {tiering} for {distinct} distinct blocks on disk: "
        f"{tiering['promotions_started'] / max(distinct, 1):.2f} started per block")
    assert identical(first, reference)[0] == identical(first, reference)[1]
    assert identical(second, reference)[0] == identical(second, reference)[1]
    assert delta["disk_promoted"] > 0
    # A promoted block is held for the request that asked for it until read: the
    # node does not promote blocks only to evict them before vLLM reads them.
    assert tiering["promotions_started"] <= 2 * distinct


def test_a_disk_tier_killed_mid_run_costs_hits_never_correctness(node, engine, references,
                                                                  say):
    reference = references.outputs(WORKLOAD)
    killed = []

    def kill_after_first_round(done: int) -> None:
        if done == 0:  # the engine goes on with the next round meanwhile
            killed.append(node.node.pid("tier:disk:0"))
            node.kill("tier:disk:0")

    result, before = run(engine, node, kill_after_first_round)
    delta = node_delta(before, node.stats())
    say(describe("disk tier SIGKILLed after round 1", result, reference, delta))
    assert killed
    same, total = identical(result, reference)
    assert same == total
    assert delta["disk_promoted"] > 0  # before the kill
    node.respawn("tier:disk:0")  # as the supervisor would


def test_a_broker_killed_mid_run_means_recompute_not_a_hang(node, engine, references, say):
    reference = references.outputs(WORKLOAD)
    before = node.stats()
    seen: dict[str, int] = {}

    def kill_after_first_round(done: int) -> None:
        if done == 0:
            stats = node.stats()
            seen.update(node_delta(before, stats))
            node.kill("broker")

    # Bounded: a request waits one `timeout_s` (0.5 s) for the broker at most, then
    # vLLM computes; `run` raises if the engine has not answered within RUN_S.
    result = engine.run(WORKLOAD, MAX_TOKENS, reset_device_cache=True, timeout_s=RUN_S,
                        on_round=kill_after_first_round)
    say(describe("broker SIGKILLed after round 1", result, reference, seen))
    same, total = identical(result, reference)
    assert same == total
    assert seen["cpu_hits"] > 0  # before the kill
    assert hits(result)["computed"] > 0
    # And the engine goes on without the node.
    again = engine.run(WORKLOAD[:1], MAX_TOKENS, reset_device_cache=True, timeout_s=RUN_S)
    assert identical(again, reference[:1])[0] == len(reference[0])
