"""Engine hints: the per-request dataclass, vLLM's kv_hints mapping, the manager's calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tierkv.core.policies import (
    CachePolicy,
    RequestHints,
    hints_from_kv_hints,
    known_policies,
    make_policy,
)
from tierkv.core.primary import PrimaryTier


def test_request_hints_validate_and_default_to_unknown():
    assert RequestHints().empty
    hints = RequestHints(session="chat-1", turn=2, continues=True, expected_next_s=3.5)
    assert not hints.empty and hints.turn == 2
    with pytest.raises(ValueError):
        RequestHints(expected_next_s=-1.0)
    with pytest.raises(ValueError):
        RequestHints(ttl_s=float("inf"))
    with pytest.raises(ValueError):
        RequestHints(turn=-1)


def envelope(*actions: tuple[str, dict[str, Any]], version: int = 1) -> dict[str, Any]:
    return {"protocol_version": 1, "message_id": "m1", "actions": [
        {"action_id": f"a{i}", "action_type": kind, "action_version": version, "payload": payload}
        for i, (kind, payload) in enumerate(actions)]}


def test_kv_hints_actions_map_onto_request_hints():
    hints = hints_from_kv_hints(envelope(
        ("session", {"session_id": "conv-7", "turn": 3}),
        ("continuation", {"continues": True, "expected_next_s": 12.0, "ttl_s": 600})))
    assert hints == RequestHints(session="conv-7", turn=3, continues=True,
                                 expected_next_s=12.0, ttl_s=600.0)
    tool = hints_from_kv_hints(envelope(("tool_call", {"expected_duration_s": 2.5})))
    assert tool == RequestHints(continues=True, expected_next_s=2.5)
    end = hints_from_kv_hints(envelope(("tool_call", {}), ("session_end", {})))
    assert end is not None and end.continues is False  # the last action wins


@dataclass
class Action:  # the shape of vLLM's KvHintAction
    action_id: str
    action_type: str
    action_version: int
    payload: dict[str, Any]


@dataclass
class Envelope:  # the shape of vLLM's KvHintsEnvelope
    protocol_version: int
    message_id: str
    actions: list[Action] = field(default_factory=list)


def test_kv_hints_objects_and_bad_input_never_raise():
    obj = Envelope(1, "m", [Action("a", "session", 1, {"session_id": 9})])
    assert hints_from_kv_hints(obj) == RequestHints(session=9)
    for bad in (None, {}, {"actions": "x"}, envelope(("bogus", {"x": 1})),
                envelope(("session", {"session_id": "s"}), version=2),
                envelope(("continuation", {"continues": "yes", "expected_next_s": -3})),
                envelope(("session", {"session_id": [1], "turn": True})),
                {"actions": [None, 3, {"action_type": 5}]}):
        assert hints_from_kv_hints(bad) is None


class Recorder(CachePolicy):
    """Records the hint calls; an LRU-less toy that evicts nothing."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.calls: list[tuple[Any, ...]] = []
        self.d: dict[Any, Any] = {}

    def get(self, key):  # noqa: ANN001, ANN201
        return self.d.get(key)

    def insert(self, key, value):  # noqa: ANN001, ANN201
        self.d[key] = value

    def remove(self, key):  # noqa: ANN001, ANN201
        self.d.pop(key, None)

    def touch(self, keys):  # noqa: ANN001, ANN201
        pass

    def evict(self, n, protected):  # noqa: ANN001, ANN201
        return None

    def __len__(self) -> int:
        return len(self.d)

    def __contains__(self, key: object) -> bool:
        return key in self.d

    def note_request(self, req_id, keys, hints, now):  # noqa: ANN001, ANN201
        self.calls.append(("request", req_id, list(keys), hints, now))

    def note_finish(self, req_id, now):  # noqa: ANN001, ANN201
        self.calls.append(("finish", req_id, now))

    def note_queue(self, chains, now):  # noqa: ANN001, ANN201
        self.calls.append(("queue", [list(c) for c in chains], now))


def test_primary_tier_passes_hints_to_its_policy_and_returns_prefetch_candidates():
    policy = Recorder(8)
    tier = PrimaryTier(8, policy)
    hints = RequestHints(session="s", continues=False)
    tier.note_request("r1", [b"a", b"b"], hints, now=5.0)
    out = tier.prepare_store([b"a", b"b"])
    tier.complete_store(out.keys_to_store)
    # Queued: [a, b, c, d] hits a b; c and d are the ones to promote; [e] too.
    assert tier.note_queue([[b"a", b"b", b"c", b"d"], [b"e"], [b"a"]], now=6.0) == [
        b"c", b"d", b"e"]
    tier.note_finish("r1", now=7.0)
    assert policy.calls == [
        ("request", "r1", [b"a", b"b"], hints, 5.0),
        ("queue", [[b"a", b"b", b"c", b"d"], [b"e"], [b"a"]], 6.0),
        ("finish", "r1", 7.0),
    ]


@pytest.mark.parametrize("name", known_policies())
def test_every_policy_accepts_the_hint_calls(name):
    """The base class's defaults do nothing; a hint-aware policy must accept any
    hint, unknown keys and unknown requests without failing."""
    policy = make_policy(name, 4)
    policy.insert(b"a", 0)
    policy.note_queue([[b"a", b"zz"], []], 0.0)
    policy.note_request(1, [b"a", b"b"], RequestHints(session=1, continues=False), 0.0)
    policy.note_request(2, [], None, 0.0)
    policy.note_finish(1, 1.0)
    policy.note_finish("never seen", 1.0)
    policy.note_queue([], 2.0)
    assert b"a" in policy and len(policy) == 1
