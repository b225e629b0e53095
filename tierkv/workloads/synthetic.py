"""Synthetic Mooncake-format workloads: multi-turn conversations over shared prefixes.

Real traces are scarce and describe one service; a policy tuned on one of them may
only have learned that service. The generator produces traces with the same shape
(`tierkv.workloads.traces.Request`, `hash_ids` = prefix block ids) whose structure is set by
a few parameters, so a policy can be checked against workloads it was not tuned on,
and a demo can drive the service without a trace file.

Model. A number of conversations are open at once; each opens with a shared system
prompt (Zipf-popular), optionally a shared document (Zipf-popular), and a first
user message, then comes back for more turns after a think time. Turn t sends the
prefix, the whole history and the new message; the last block of every request is
partial (its tokens change next turn), so it is never reused, as in Mooncake.
Optional one-off requests (batch jobs, long unique prompts) are a scan that a cache
should not keep. Block ids come from a prefix trie: equal prefixes get equal ids,
and the same document behind two different system prompts gets different ids, as a
prefix hash would.

Everything is drawn from one `random.Random(seed)`: a seed fixes the trace.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv.workloads.traces import MOONCAKE_BLOCK_TOKENS, Request

Span = tuple[int, int]  # an inclusive (low, high) range of block counts


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The parameters of a synthetic workload (see `generate_conversations`)."""

    conversations: int = 64  # open at once; with `turns` it sets the reuse distance
    turns: float = 4.0  # mean turns per conversation (geometric, at least 1)
    system_prompts: int = 4
    system_prompt_blocks: int = 2
    documents: int = 0
    document_blocks: Span = (8, 32)
    document_share: float = 0.0  # fraction of conversations that open with a document
    zipf: float = 1.0  # popularity skew of system prompts and documents
    first_blocks: Span = (1, 8)  # new blocks of a conversation's first message
    turn_blocks: Span = (1, 4)  # new blocks of each later message
    answer_blocks: Span = (1, 2)  # blocks an answer adds to the history
    pace_spread: float = 1.0  # lognormal sigma of the per-conversation think time
    one_off_share: float = 0.0  # fraction of requests that are one-off scans
    one_off_blocks: Span = (16, 64)

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.system_prompts < 1:
            raise ValueError("conversations and system_prompts must be at least 1")
        if self.turns < 1:
            raise ValueError(f"turns is a mean number of turns, at least 1, got {self.turns}")
        if not 0.0 <= self.document_share <= 1.0 or not 0.0 <= self.one_off_share < 1.0:
            raise ValueError("document_share must be in [0, 1] and one_off_share in [0, 1)")
        if self.document_share > 0 and self.documents < 1:
            raise ValueError("document_share > 0 needs documents >= 1")
        for name in ("document_blocks", "first_blocks", "turn_blocks", "answer_blocks",
                     "one_off_blocks"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a (low, high) range with 0 <= low <= high")


# Structurally different settings, used to check that a policy is not tuned to one
# trace; each has a working set of thousands to tens of thousands of blocks, the
# range where a CPU tier of 1000-16000 blocks has choices to make.
# "chat": many long conversations open at once, reuse only along each conversation's
# chain (the shape of Mooncake's conversation trace, with more turns).
# "docs": short conversations that mostly open with one of many shared documents of
# Zipf popularity, so reuse is across conversations.
# "scan": chat interleaved with long one-off requests that must not flush it.
PRESETS: dict[str, WorkloadSpec] = {
    "chat": WorkloadSpec(
        conversations=300, turns=4.0, system_prompts=4, system_prompt_blocks=2,
        first_blocks=(4, 40), turn_blocks=(1, 3),
    ),
    "docs": WorkloadSpec(
        conversations=64, turns=1.5, system_prompts=2, system_prompt_blocks=1,
        documents=2000, document_blocks=(8, 48), document_share=0.9, zipf=0.8,
        first_blocks=(1, 3), turn_blocks=(1, 2),
    ),
    "scan": WorkloadSpec(
        conversations=96, turns=6.0, system_prompts=4, system_prompt_blocks=2,
        first_blocks=(4, 24), turn_blocks=(1, 3), one_off_share=0.4,
        one_off_blocks=(24, 96),
    ),
}


def generate_conversations(
    n_requests: int, *, seed: int = 0, spec: WorkloadSpec | None = None, **params: Any
) -> list[Request]:
    """`n_requests` requests of multi-turn conversations, in arrival order.

    Parameters are those of `WorkloadSpec`, given as keywords or as `spec` (keywords
    override it). Timestamps are in ms at about one request per second."""
    if n_requests < 0:
        raise ValueError(f"n_requests must be >= 0, got {n_requests}")
    spec = spec or WorkloadSpec()
    if params:
        spec = _replace(spec, params)
    return _Generator(spec, random.Random(seed)).run(n_requests)


def generate_workload(name: str, n_requests: int, *, seed: int = 0) -> list[Request]:
    """A preset workload by name (see `PRESETS`)."""
    try:
        spec = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(PRESETS)}") from None
    return generate_conversations(n_requests, seed=seed, spec=spec)


def _replace(spec: WorkloadSpec, params: dict[str, Any]) -> WorkloadSpec:
    known = set(WorkloadSpec.__dataclass_fields__)
    unknown = set(params) - known
    if unknown:
        raise TypeError(f"unknown workload parameter(s): {', '.join(sorted(unknown))}")
    return WorkloadSpec(**{**{k: getattr(spec, k) for k in known}, **params})


class _PrefixIds:
    """Block ids from a trie: the id of a block is fixed by its parent id and content."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Hashable], int] = {}
        self._next = itertools.count()

    def chain(self, contents: Sequence[Hashable]) -> tuple[int, ...]:
        ids = []
        parent = -1
        for content in contents:
            node = (parent, content)
            block = self._ids.get(node)
            if block is None:
                block = self._ids[node] = next(self._next)
            ids.append(block)
            parent = block
        return tuple(ids)


@dataclass(slots=True)
class _Conversation:
    serial: int
    turns_left: int
    pace: float  # mean think time, in request slots
    history: list[Hashable] = field(default_factory=list)  # block contents sent so far
    turn: int = 0


class _Generator:
    def __init__(self, spec: WorkloadSpec, rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self.ids = _PrefixIds()
        self.prompt_weights = _zipf_cumulative(spec.system_prompts, spec.zipf)
        self.doc_weights = _zipf_cumulative(max(spec.documents, 1), spec.zipf)
        self.doc_lengths = [self._span(spec.document_blocks) for _ in range(spec.documents)]
        self.serials = itertools.count()
        self.requests = itertools.count()

    def run(self, n_requests: int) -> list[Request]:
        spec, rng = self.spec, self.rng
        # (next turn time, tiebreak, conversation): the conversation that speaks next.
        agenda: list[tuple[float, int, _Conversation]] = []
        for _ in range(spec.conversations):
            conv = self._open()
            heapq.heappush(agenda, (rng.expovariate(1.0 / conv.pace), conv.serial, conv))
        out: list[Request] = []
        now = 0.0
        while len(out) < n_requests:
            if spec.one_off_share and rng.random() < spec.one_off_share:
                out.append(self._one_off(now))
                continue
            now, _, conv = heapq.heappop(agenda)
            out.append(self._turn(conv, now))
            if conv.turns_left == 0:
                conv = self._open()
            heapq.heappush(agenda, (now + rng.expovariate(1.0 / conv.pace), conv.serial, conv))
        return out

    def _open(self) -> _Conversation:
        spec, rng = self.spec, self.rng
        serial = next(self.serials)
        # Geometric number of turns with the requested mean (at least one).
        turns = 1
        while rng.random() > 1.0 / spec.turns:
            turns += 1
        # Think times vary per conversation; the mean gap between two turns of one
        # conversation is about `conversations` request slots.
        pace = spec.conversations * rng.lognormvariate(0.0, spec.pace_spread) / _lognormal_mean(
            spec.pace_spread)
        conv = _Conversation(serial, turns, pace)
        prompt = _draw(rng, self.prompt_weights)
        conv.history = [("sys", prompt, i) for i in range(spec.system_prompt_blocks)]
        if spec.documents and rng.random() < spec.document_share:
            doc = _draw(rng, self.doc_weights)
            conv.history += [("doc", doc, i) for i in range(self.doc_lengths[doc])]
        return conv

    def _turn(self, conv: _Conversation, now: float) -> Request:
        spec = self.spec
        span = spec.first_blocks if conv.turn == 0 else spec.turn_blocks
        message = [("msg", conv.serial, conv.turn, i) for i in range(self._span(span))]
        # The last block is partial: next turn it holds more tokens, hence a new id.
        contents = conv.history + message + [("tail", next(self.requests))]
        answer = [("ans", conv.serial, conv.turn, i) for i in range(self._span(spec.answer_blocks))]
        conv.history = conv.history + message + answer
        conv.turn += 1
        conv.turns_left -= 1
        return self._request(contents, now)

    def _one_off(self, now: float) -> Request:
        serial = next(self.requests)
        contents = [("once", serial, i) for i in range(self._span(self.spec.one_off_blocks))]
        return self._request(contents, now)

    def _request(self, contents: Sequence[Hashable], now: float) -> Request:
        rng = self.rng
        hash_ids = self.ids.chain(contents)
        input_length = len(hash_ids) * MOONCAKE_BLOCK_TOKENS - rng.randrange(MOONCAKE_BLOCK_TOKENS)
        return Request(round(now * 1000.0, 3), max(input_length, 1), rng.randint(16, 1024),
                       hash_ids)

    def _span(self, span: Span) -> int:
        return self.rng.randint(span[0], span[1])


def _zipf_cumulative(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))


def _draw(rng: random.Random, cumulative: list[float]) -> int:
    return bisect.bisect_right(cumulative, rng.random() * cumulative[-1])


def _lognormal_mean(sigma: float) -> float:
    return math.exp(sigma * sigma / 2.0)
