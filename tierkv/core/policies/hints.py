"""What the engine knows about a request that the cache does not: per-request hints.

A policy sees only keys (insert, touch, evict). The engine and the orchestrator in
front of it know more: which conversation or agent run a request belongs to, whether
that session will send another turn (an agent framework knows a tool call will
return; a chat front-end knows the user closed the tab), sometimes when, and which
requests are waiting in the scheduler's queue. `RequestHints` carries the
per-request part; the waiting queue is passed per step as key chains (see
`CachePolicy.note_queue`).

Hints are advice. A missing or wrong hint never costs correctness (it only moves a
block earlier or later in the eviction order), and a policy that uses them is
expected to learn how far to trust them from what actually happens.

`hints_from_kv_hints` maps vLLM's orchestrator hints (`kv_hints`, an envelope of
versioned actions with JSON payloads, passed to the offloading manager in
`ReqContext`) onto `RequestHints`. The action types it understands, version 1
(other versions and unknown types are ignored, so a newer orchestrator never breaks
an older node):

=====================  ===========================================================
action_type            payload (JSON object; every field optional)
=====================  ===========================================================
``session``            ``session_id`` (str or int), ``turn`` (int, 0 = first)
``continuation``       ``continues`` (bool): the session will send another turn;
                       ``expected_next_s`` (float): seconds until it does;
                       ``ttl_s`` (float): the session's blocks are worth keeping
                       this long and no longer
``tool_call``          the request ends in a tool call that the orchestrator will
                       answer: implies ``continues = true``;
                       ``expected_duration_s`` (float) -> ``expected_next_s``
``session_end``        the session sends no further turn: ``continues = false``
=====================  ===========================================================

Aliases accepted for robustness: ``conversation``/``session_id`` for ``session``,
``continue``/``keep_alive`` for ``continuation``, ``end``/``session_close`` for
``session_end``. When actions disagree, the last one wins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestHints:
    """Per-request context from the engine; every field may be unknown (None).

    * `session`: the conversation, agent run or other chain of requests this one
      belongs to. Blocks named by requests of two different sessions are *shared*
      (a system prompt, a document): one session's hint never demotes them.
    * `turn`: the request's position in its session (0 = first).
    * `continues`: True if the session will send another turn after this request,
      False if this is its last; None if unknown.
    * `expected_next_s`: seconds from this request until the session's next turn.
    * `ttl_s`: seconds after this request for which the session's blocks are worth
      keeping; after that they are treated like a finished session's.
    """

    session: str | int | None = None
    turn: int | None = None
    continues: bool | None = None
    expected_next_s: float | None = None
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("expected_next_s", "ttl_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value >= 0
                                          and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.turn is not None and (not isinstance(self.turn, int) or self.turn < 0):
            raise ValueError(f"turn must be an int >= 0, got {self.turn!r}")

    @property
    def empty(self) -> bool:
        return (self.session is None and self.turn is None and self.continues is None
                and self.expected_next_s is None and self.ttl_s is None)


_SESSION = {"session", "conversation", "session_id"}
_CONTINUATION = {"continuation", "continue", "keep_alive"}
_TOOL_CALL = {"tool_call"}
_END = {"session_end", "end", "session_close"}
SUPPORTED_ACTION_VERSION = 1


def hints_from_kv_hints(kv_hints: Any) -> RequestHints | None:
    """`RequestHints` from vLLM's `kv_hints` (a `KvHintsEnvelope`, or the same as a
    mapping: ``{"protocol_version", "message_id", "actions": [{"action_id",
    "action_type", "action_version", "payload"}]}``). None if it carries nothing
    this module understands. Malformed actions are skipped, never raised: hints
    are advice and must not fail a request."""
    if kv_hints is None:
        return None
    actions = _field(kv_hints, "actions")
    if not isinstance(actions, list | tuple):
        return None
    fields: dict[str, Any] = {}
    for action in actions:
        kind = _field(action, "action_type")
        version = _field(action, "action_version", SUPPORTED_ACTION_VERSION)
        payload = _field(action, "payload") or {}
        if not isinstance(kind, str) or not isinstance(payload, Mapping):
            continue
        if version not in (None, SUPPORTED_ACTION_VERSION, str(SUPPORTED_ACTION_VERSION)):
            continue
        kind = kind.lower()
        if kind in _SESSION:
            session = payload.get("session_id", payload.get("id"))
            if isinstance(session, str | int) and not isinstance(session, bool):
                fields["session"] = session
            turn = payload.get("turn")
            if isinstance(turn, int) and not isinstance(turn, bool) and turn >= 0:
                fields["turn"] = turn
        elif kind in _CONTINUATION:
            if isinstance(payload.get("continues"), bool):
                fields["continues"] = payload["continues"]
            _seconds(payload, "expected_next_s", fields, "expected_next_s")
            _seconds(payload, "ttl_s", fields, "ttl_s")
        elif kind in _TOOL_CALL:
            fields["continues"] = True
            _seconds(payload, "expected_duration_s", fields, "expected_next_s")
        elif kind in _END:
            fields["continues"] = False
            fields.pop("expected_next_s", None)
    if not fields:
        return None
    return RequestHints(**fields)


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _seconds(payload: Mapping[str, Any], name: str, fields: dict[str, Any], to: str) -> None:
    value = payload.get(name)
    if (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0):
        fields[to] = float(value)
