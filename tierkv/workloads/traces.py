"""Workload traces in the Mooncake format, and the prefix-cache replay over them.

A trace is one JSON object per line: `timestamp` (ms), `input_length`,
`output_length` and `hash_ids`, the ids of the request's prefix blocks (512 tokens
each in the Mooncake release); equal ids are the same reusable prefix block.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

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


def prefix_hit_ratio(requests: Iterable[Request], tier) -> float:  # noqa: ANN001
    """Replay requests against a `PrimaryTier`: a request hits on its leading run of
    cached blocks (loaded: a use); then all its blocks are stored. Returns
    hit blocks / requested blocks."""
    hits = total = 0
    for request in requests:
        keys = request.keys()
        n = tier.lookup(keys)
        if n:
            tier.prepare_load(keys[:n])
            tier.complete_load(keys[:n])
        out = tier.prepare_store(keys)
        if out is not None and out.keys_to_store:
            tier.complete_store(out.keys_to_store)
        hits += n
        total += len(keys)
    return hits / total if total else 0.0
