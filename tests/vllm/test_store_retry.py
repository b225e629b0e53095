"""Stores of requests vLLM admits together, on a CPU tier too small to hold rows
ahead for all of them: vLLM's real Scheduler and `TierkvConnector` on a real node
(broker and disk tier processes). A store that finds no rows in its step is made in
a later one, and every request's prefix ends up in the node."""

from __future__ import annotations

import time

from tests.vllm.conftest import SHAPE, extra_config, manager_of, node_statuses
from tests.vllm.test_connector import node_stats
from tierkv.bench.vllm_engine import Engine

DOC_BLOCKS = 10
GROUPS = (2, 3)  # requests added to vLLM at once, then run to the end
CASCADE_S = 30.0


def documents(n: int) -> list[list[int]]:
    return [[100 + d * 1000 + i for i in range(DOC_BLOCKS * SHAPE.block_size)]
            for d in range(n)]


def document_keys(engine: Engine, doc: list[int]) -> list[bytes]:
    """The tierkv keys of a document's full blocks, as the engine's manager makes them."""
    from vllm import SamplingParams
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.request import Request

    probe = Request("probe", list(doc), SamplingParams(max_tokens=1), None,
                    block_hasher=engine._hasher)
    chunks = [make_offload_key(h, 0) for h in probe.block_hashes[:DOC_BLOCKS]]
    return manager_of(engine).keymap.keys(chunks)


def run_in_groups(node, engine: Engine, docs: list[list[int]], tag: int) -> None:
    """Every document once, its requests added `GROUPS` at a time. Between groups the
    node copies what it holds down to disk (rows it may then evict): the groups'
    stores compete for rows with each other, not with a disk a loaded machine slows."""
    at = 0
    while at < len(docs):
        for size in GROUPS:
            for doc in docs[at:at + size]:
                engine.add(doc + [7, 8, tag], max_tokens=1)  # its last offer comes at once
            at += size
            engine.run()
            cascaded(node, CASCADE_S)


def cascaded(node, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while node_stats(node)["tiering"]["cascades_in_flight"]:
        assert time.monotonic() < deadline, f"cascades still in flight after {timeout_s} s"
        time.sleep(0.01)


def missing_documents(node, engine: Engine, docs: list[list[int]]) -> list[int]:
    """Documents with a block the node does not have (on any tier)."""
    return [d for d, doc in enumerate(docs)
            if "miss" in node_statuses(node, document_keys(engine, doc))]


def test_requests_added_together_each_store_their_prefix(start_node):
    # Room for three documents: the engine's share of it is held by the stores in
    # flight and the rows held ahead, and a request ends a step after its prefill.
    node = start_node(cpu_blocks=30)
    engine = Engine(SHAPE, extra_config(node))
    docs = documents(5)
    try:
        for tag in range(3):
            run_in_groups(node, engine, docs, tag)
            assert missing_documents(node, engine, docs) == [], f"after round {tag + 1}"
    finally:
        engine.close()
    assert engine.mismatches == []
