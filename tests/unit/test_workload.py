"""The synthetic workload generator: determinism, prefix ids, the promised structure."""

from __future__ import annotations

from collections import Counter

import pytest

from tierkv.bench.belady import prefix_consistent
from tierkv.workloads.synthetic import (
    PRESETS,
    AgentSpec,
    RagSpec,
    WorkloadSpec,
    generate_agents,
    generate_conversations,
    generate_rag,
    generate_workload,
)
from tierkv.workloads.traces import sessions

PREFIX_PRESETS = sorted(n for n, spec in PRESETS.items() if getattr(spec, "ids", "") != "content")


def parents(trace) -> dict[int, int]:
    """id -> the id before it; fails if an id ever follows two different ids."""
    seen: dict[int, int] = {}
    for request in trace:
        for i, block in enumerate(request.hash_ids):
            parent = request.hash_ids[i - 1] if i else -1
            assert seen.setdefault(block, parent) == parent, f"id {block} has two prefixes"
    return seen


def test_deterministic_for_a_seed():
    assert generate_conversations(300, seed=5) == generate_conversations(300, seed=5)
    assert generate_conversations(300, seed=5) != generate_conversations(300, seed=6)
    assert len(generate_conversations(123)) == 123 and generate_conversations(0) == []


@pytest.mark.parametrize("name", PREFIX_PRESETS)
def test_presets_have_prefix_ids_and_partial_last_blocks(name):
    trace = generate_workload(name, 400, seed=1)
    assert len(trace) == 400
    parents(trace)  # equal id => equal prefix
    times = [r.timestamp_ms for r in trace]
    assert times == sorted(times)
    # The last block of a request is partial: it is never requested again.
    counts = Counter(h for r in trace for h in r.hash_ids)
    assert all(counts[r.hash_ids[-1]] == 1 for r in trace)
    assert all(r.input_length <= 512 * len(r.hash_ids) for r in trace)


def test_conversations_extend_their_history():
    trace = generate_conversations(400, seed=2, conversations=8, turns=6.0, system_prompts=1)
    index = {r.hash_ids[:-1]: i for i, r in enumerate(trace)}
    continued = 0
    for i, request in enumerate(trace):
        # A later turn starts with an earlier turn's full blocks (all but the tail).
        for end in range(len(request.hash_ids) - 1, 0, -1):
            j = index.get(request.hash_ids[:end])
            if j is not None and j < i:
                continued += 1
                break
    assert continued > len(trace) // 2
    # One system prompt of 2 blocks: every request starts with the same two ids.
    assert len({r.hash_ids[:2] for r in trace}) == 1


def test_documents_are_shared_across_conversations():
    trace = generate_workload("docs", 600, seed=3)
    # Block 1 (after the one-block system prompt) is a document's first block when
    # the conversation opened with one; popular documents open many conversations.
    openers = Counter(r.hash_ids[1] for r in trace if len(r.hash_ids) > 2)
    assert openers.most_common(1)[0][1] >= 10


def test_same_document_behind_two_prompts_gets_two_ids():
    trace = generate_conversations(
        300, seed=4, system_prompts=2, system_prompt_blocks=1, documents=1,
        document_blocks=(4, 4), document_share=1.0, zipf=0.0)
    second_blocks = {r.hash_ids[1] for r in trace}
    assert len({r.hash_ids[0] for r in trace}) == 2 and len(second_blocks) == 2


def test_scan_share_of_one_off_requests():
    trace = generate_workload("scan", 1000, seed=5)
    counts = Counter(h for r in trace for h in r.hash_ids)
    one_off = [r for r in trace if all(counts[h] == 1 for h in r.hash_ids)]
    assert abs(len(one_off) / len(trace) - PRESETS["scan"].one_off_share) < 0.1


def test_turn_count_and_spec_validation():
    with pytest.raises(ValueError):
        WorkloadSpec(turns=0.5)
    with pytest.raises(ValueError):
        WorkloadSpec(document_share=0.5)  # no documents
    with pytest.raises(ValueError):
        WorkloadSpec(first_blocks=(3, 1))
    with pytest.raises(TypeError, match="unknown workload parameter"):
        generate_conversations(1, bogus=1)
    with pytest.raises(ValueError, match="unknown workload"):
        generate_workload("nope", 1)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_deterministic_and_in_time_order(name):
    a, b = generate_workload(name, 300, seed=7), generate_workload(name, 300, seed=7)
    assert a == b and len(a) == 300
    assert [r.timestamp_ms for r in a] == sorted(r.timestamp_ms for r in a)
    assert a != generate_workload(name, 300, seed=8)


def test_agent_sessions_grow_by_tool_results_and_share_their_prompt():
    trace = generate_agents(800, seed=1, agents=16, steps=8.0, agent_types=2)
    structure = sessions(trace)
    # Sessions run many steps; each step extends the previous one's full blocks.
    assert sum(structure.continues) / len(trace) > 0.75
    assert max(structure.turn) >= 10
    # Two agent types: every request opens with one of two long prompts.
    first = Counter(r.hash_ids[0] for r in trace)
    assert len(first) == 2
    assert prefix_consistent([r.hash_ids for r in trace])
    # Tool durations vary: some next steps come at once, others much later.
    gaps = []
    last: dict[int, float] = {}
    for request, sid in zip(trace, structure.session, strict=True):
        if sid in last:
            gaps.append(request.timestamp_ms - last[sid])
        last[sid] = request.timestamp_ms
    gaps.sort()
    assert gaps[len(gaps) // 10] * 10 < gaps[9 * len(gaps) // 10]


def test_rag_prefix_ids_versus_content_ids():
    params = dict(sessions=16, documents=50, chunks=(3, 3), zipf=1.2, turns=1.0)
    chained = generate_rag(600, seed=2, **params)
    content = generate_rag(600, seed=2, ids="content", repeat_share=0.5, **params)
    assert prefix_consistent([r.hash_ids for r in chained])
    assert not prefix_consistent([r.hash_ids for r in content])
    # Content ids: a popular passage has one id wherever it appears, so fewer ids.
    distinct = [len({h for r in t for h in r.hash_ids}) for t in (chained, content)]
    assert distinct[1] < distinct[0]
    # The odd duplicate passage: some requests name an id twice.
    assert any(len(set(r.hash_ids)) < len(r.hash_ids) for r in content)


def test_agent_and_rag_spec_validation():
    with pytest.raises(ValueError):
        AgentSpec(steps=0.5)
    with pytest.raises(ValueError):
        AgentSpec(tool_seconds=0)
    with pytest.raises(ValueError):
        RagSpec(ids="bogus")
    with pytest.raises(ValueError):
        RagSpec(chunks=(0, 0))
    with pytest.raises(TypeError, match="unknown workload parameter"):
        generate_rag(1, bogus=1)
