"""Workload traces in the Mooncake format, and the prefix-cache replay over them.

A trace is one JSON object per line: `timestamp` (ms), `input_length`,
`output_length` and `hash_ids`, the ids of the request's prefix blocks (512 tokens
each in the Mooncake release); equal ids are the same reusable prefix block.

Counting. A request's blocks are its `hash_ids` *positions*: a request that names
the same id twice counts it twice, hit or missed, here and in `tierkv.bench.belady`.

Sessions. A trace has no session ids, but its structure shows most of them, as
`sessions` reconstructs: a request continues an earlier one when it starts with all
of that request's full blocks (all but the last, which is partial and changes next
turn) and those include a block that the earlier request's session introduced. A
shared prefix alone (a system prompt, a document) never links two requests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.core.keys import OffloadKey

MOONCAKE_BLOCK_TOKENS = 512
#: The Mooncake conversation trace where a checkout finds it (`../shared/data` beside
#: it; `TIERKV_MOONCAKE_TRACE` overrides). Benchmarks default to it; nothing needs it.
MOONCAKE_TRACE = Path(os.environ.get("TIERKV_MOONCAKE_TRACE") or (
    Path(__file__).resolve().parents[3] / "shared/data/mooncake-fast25/conversation_trace.jsonl"))


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def keys(self) -> list[OffloadKey]:
        return [block_key(h) for h in self.hash_ids]


def block_key(hash_id: int) -> OffloadKey:
    return hash_id.to_bytes(8, "big", signed=False)


class TraceError(ValueError):
    """A trace line that is not a Mooncake request; the message names the line."""


def read_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    return list(iter_trace(path, limit))


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[Request]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and lineno > limit:
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                yield Request(
                    float(obj["timestamp"]),
                    int(obj.get("input_length", 0)),
                    int(obj.get("output_length", 0)),
                    tuple(int(h) for h in obj["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{lineno}: not a Mooncake request ({e})") from e


TRACE_ENV = "TIERKV_TRACE"
CONVERSATION_TRACE = Path("shared/data/mooncake-fast25/conversation_trace.jsonl")


def default_trace_path() -> Path | None:
    """The Mooncake conversation trace, if this machine has it: `$TIERKV_TRACE`, else
    `shared/data/mooncake-fast25/conversation_trace.jsonl` under the current
    directory, the repository or any directory above it. None if absent."""
    env = os.environ.get(TRACE_ENV)
    if env:
        return Path(env) if Path(env).exists() else None
    here = Path(__file__).resolve().parent
    for base in (Path.cwd(), *Path.cwd().parents, here, *here.parents):
        candidate = base / CONVERSATION_TRACE
        if candidate.exists():
            return candidate
    return None


def prefix_hit_ratio(
    requests: Sequence[Request],
    tier,  # noqa: ANN001
    *,
    hints: Sequence[Any] | None = None,
    queue: int = 0,
) -> float:
    """Replay requests against a `PrimaryTier`: a request hits on its leading run of
    cached blocks (loaded: a use); then all its blocks are stored. Returns
    hit blocks / requested blocks (positions, see the module's doc).

    Each request is one engine step. The tier is told what an engine would tell it:
    every request's key chain (`note_request`, with `hints[i]` if given, else None)
    and its end (`note_finish`); with `queue` > 0, before each request, the key
    chains of the next `queue` requests in arrival order (`note_queue`). Times are
    the trace's, in seconds."""
    hits = total = 0
    chains = [r.keys() for r in requests] if queue > 0 else None
    noted = hasattr(tier, "note_request")
    for i, request in enumerate(requests):
        keys = chains[i] if chains is not None else request.keys()
        now = request.timestamp_ms / 1000.0
        if chains is not None:
            tier.note_queue(chains[i + 1:i + 1 + queue], now)
        hits += serve_request(tier, keys, i, hints[i] if hints is not None else None, now,
                              noted)
        total += len(keys)
    return hits / total if total else 0.0


def serve_request(tier, keys: list[bytes], req_id: int, hints: Any, now: float,  # noqa: ANN001
                  noted: bool = True) -> int:
    """One request as an engine serves it: the tier is told of it (if `noted`), its
    leading hits are loaded (a use), all its blocks stored, and it finishes. Returns
    the hits."""
    if noted:
        tier.note_request(req_id, keys, hints, now)
    n: int = tier.lookup(keys)
    if n:
        tier.prepare_load(keys[:n])
        tier.complete_load(keys[:n])
    out = tier.prepare_store(keys)
    if out is not None and out.keys_to_store:
        tier.complete_store(out.keys_to_store)
    if noted:
        tier.note_finish(req_id, now)
    return n


@dataclass(frozen=True, slots=True)
class Sessions:
    """The session structure of a trace, co-indexed with its requests."""

    session: tuple[int, ...]  # session number, in order of first appearance
    turn: tuple[int, ...]  # 0 for a session's first request
    continues: tuple[bool, ...]  # the session has a later request

    @property
    def count(self) -> int:
        return max(self.session, default=-1) + 1


def sessions(requests: Sequence[Request]) -> Sessions:
    """Reconstruct sessions from the trace's structure (see the module's doc).

    A request continues the most recent earlier request, not yet continued, whose
    full blocks are a prefix of its own (the longest such prefix wins) and include a
    block introduced by that request's session. O(blocks) with rolling prefix
    hashes; works whether or not ids follow a fixed parent."""
    session: list[int] = []
    turn: list[int] = []
    continues: list[bool] = []
    introduced: dict[int, int] = {}  # block id -> the session that first named it
    open_ends: dict[int, int] = {}  # prefix hash of a request's full blocks -> request
    sessions_seen = 0
    for i, request in enumerate(requests):
        ids = request.hash_ids
        prefix = [0] * (len(ids) + 1)  # prefix[k]: hash of ids[:k]
        h = 0
        for k, block in enumerate(ids):
            h = hash((h, block))
            prefix[k + 1] = h
        parent = None
        for k in range(len(ids), 0, -1):
            j = open_ends.get(prefix[k])
            if j is not None and requests[j].hash_ids[:k] == ids[:k]:
                parent = j
                del open_ends[prefix[k]]
                break
        if parent is None:
            sid, t = sessions_seen, 0
            sessions_seen += 1
        else:
            sid, t = session[parent], turn[parent] + 1
            continues[parent] = True
        session.append(sid)
        turn.append(t)
        continues.append(False)
        for block in ids:
            introduced.setdefault(block, sid)
        if any(introduced[b] == sid for b in ids[:-1]):
            open_ends[prefix[len(ids) - 1]] = i
    return Sessions(tuple(session), tuple(turn), tuple(continues))
