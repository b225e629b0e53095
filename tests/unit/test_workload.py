"""The synthetic workload generator: determinism, prefix ids, the promised structure."""

from __future__ import annotations

from collections import Counter

import pytest

from tierkv.workloads.synthetic import (
    PRESETS,
    WorkloadSpec,
    generate_conversations,
    generate_workload,
)


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


@pytest.mark.parametrize("name", sorted(PRESETS))
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
