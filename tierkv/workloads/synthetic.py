"""Synthetic Mooncake-format workloads: conversations, agents and RAG over shared prefixes.

Real traces are scarce and describe one service; a policy tuned on one of them may
only have learned that service. The generators produce traces with the same shape
(`tierkv.workloads.traces.Request`, `hash_ids` = prefix block ids) whose structure is set by
a few parameters, so a policy can be checked against workloads it was not tuned on,
and a demo can drive the service without a trace file. Three families:

* conversations (`WorkloadSpec`, `generate_conversations`): described below;
* agent sessions with tool calls (`AgentSpec`, `generate_agents`);
* retrieval-augmented generation over a shared document pool (`RagSpec`,
  `generate_rag`).

`PRESETS` names structurally different settings of all three; `generate_workload`
makes any of them.

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

Agents. An agent session opens with a long shared prompt (instructions and tool
schemas, Zipf-popular among a few agent types) and a task, then loops: the model
answers with a tool call, the tool runs for a while (lognormal: from a fraction of a
second to minutes, so a session's next request may come right away or long after),
and its result (lognormal length: a status line or a whole file) is appended for the
next request. Sessions run for many steps (geometric) and are replaced when done.
Timestamps are real seconds (ms in the trace), new sessions arriving as a Poisson
stream so that about `agents` are open at once.

RAG. Each query opens with a shared system prompt, then the `chunks` passages a
retriever returned from a pool of `documents` (Zipf popularity), then the question;
a follow-up question (geometric number of turns) keeps the passages and the
history. With `ids="prefix"` block ids are chained hashes, as an engine's prefix
cache sees them: a passage has one id per prefix it follows. With
`ids="content"` a passage's blocks keep the same ids wherever they appear (a
position-independent store), so ids follow several parents and a request may
repeat one (`repeat_share`): such traces have no exact Belady (see
`tierkv.bench.belady`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Callable, Hashable, Sequence
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


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """Agent sessions with tool calls (see `generate_agents`)."""

    agents: int = 48  # sessions open at once (on average)
    steps: float = 10.0  # mean requests per session (geometric, at least 1)
    agent_types: int = 6  # shared prompts (instructions + tool schemas), Zipf-popular
    prompt_blocks: Span = (6, 24)
    zipf: float = 1.0
    task_blocks: Span = (1, 6)  # the user's task
    call_blocks: Span = (0, 1)  # the model's tool call, appended to the history
    result_blocks: float = 3.0  # median tool-result length (lognormal), in blocks
    result_spread: float = 1.2  # lognormal sigma of the result length
    max_result_blocks: int = 96
    tool_seconds: float = 4.0  # median tool duration (lognormal)
    tool_spread: float = 1.5  # lognormal sigma of the tool duration
    decode_seconds: float = 2.0  # mean time to generate a step's output (exponential)

    def __post_init__(self) -> None:
        if self.agents < 1 or self.agent_types < 1 or self.steps < 1:
            raise ValueError("agents, agent_types and steps must be at least 1")
        if min(self.tool_seconds, self.decode_seconds, self.result_blocks) <= 0:
            raise ValueError("tool_seconds, decode_seconds and result_blocks must be > 0")
        for name in ("prompt_blocks", "task_blocks", "call_blocks"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a (low, high) range with 0 <= low <= high")


@dataclass(frozen=True, slots=True)
class RagSpec:
    """Retrieval-augmented queries over a shared document pool (see `generate_rag`)."""

    sessions: int = 64  # open at once; with `turns` it sets the reuse distance
    turns: float = 1.5  # mean questions per session (geometric, at least 1)
    documents: int = 4000  # passages in the pool
    chunk_blocks: Span = (1, 4)  # blocks per passage
    chunks: Span = (3, 6)  # passages retrieved per question
    zipf: float = 1.0  # popularity skew of passages
    sorted_chunks: bool = False  # passages in pool order (improves prefix reuse)
    system_prompts: int = 2
    system_prompt_blocks: int = 2
    question_blocks: Span = (1, 2)
    answer_blocks: Span = (1, 2)
    ids: str = "prefix"  # "prefix": chained hashes; "content": an id per passage block
    repeat_share: float = 0.0  # content ids: chance that a retrieved passage repeats

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.documents < 1 or self.system_prompts < 1:
            raise ValueError("sessions, documents and system_prompts must be at least 1")
        if self.turns < 1:
            raise ValueError(f"turns is a mean number of turns, at least 1, got {self.turns}")
        if self.ids not in ("prefix", "content"):
            raise ValueError(f"ids must be 'prefix' or 'content', got {self.ids!r}")
        if not 0.0 <= self.repeat_share < 1.0:
            raise ValueError("repeat_share must be in [0, 1)")
        for name in ("chunk_blocks", "chunks", "question_blocks", "answer_blocks"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a (low, high) range with 0 <= low <= high")
        if self.chunk_blocks[1] < 1 or self.chunks[1] < 1:
            raise ValueError("chunk_blocks and chunks need a high end of at least 1")


# Structurally different settings, used to check that a policy is not tuned to one
# trace; each has a working set of thousands to tens of thousands of blocks, the
# range where a CPU tier of 1000-16000 blocks has choices to make.
# "chat": many long conversations open at once, reuse only along each conversation's
# chain (the shape of Mooncake's conversation trace, with more turns).
# "docs": short conversations that mostly open with one of many shared documents of
# Zipf popularity, so reuse is across conversations.
# "scan": chat interleaved with long one-off requests that must not flush it.
# "longdoc": the shape of Mooncake's synthetic trace (FAST'25 release): long prompts
# (a document, 10-100 blocks) asked about again minutes later with one new block
# each time, some asked once, between short one-off chats that are never reused.
# "agent": agent sessions with tool calls of varying duration and result length.
# "rag": questions over a shared passage pool, chained (prefix) block ids.
# "rag-content": the same with content-addressed passage blocks: ids follow several
# parents and requests repeat some (reported against an upper bound, not Belady).
PRESETS: dict[str, Any] = {
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
    "longdoc": WorkloadSpec(
        conversations=200, turns=2.5, system_prompts=1, system_prompt_blocks=0,
        first_blocks=(10, 100), turn_blocks=(1, 1), answer_blocks=(0, 0),
        pace_spread=1.2, one_off_share=0.35, one_off_blocks=(1, 2),
    ),
    "agent": AgentSpec(agents=160),
    "rag": RagSpec(sessions=160, documents=20000, zipf=0.9),
    "rag-content": RagSpec(sessions=160, documents=20000, zipf=0.9, ids="content",
                           sorted_chunks=True, repeat_share=0.05),
}


def generate_conversations(
    n_requests: int, *, seed: int = 0, spec: WorkloadSpec | None = None, **params: Any
) -> list[Request]:
    """`n_requests` requests of multi-turn conversations, in arrival order.

    Parameters are those of `WorkloadSpec`, given as keywords or as `spec` (keywords
    override it). Timestamps are in ms at about one request per second."""
    return _Generator(_spec(n_requests, spec or WorkloadSpec(), params), seed).run(n_requests)


def generate_workload(name: str, n_requests: int, *, seed: int = 0) -> list[Request]:
    """A preset workload by name (see `PRESETS`)."""
    try:
        spec = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(PRESETS)}") from None
    if isinstance(spec, AgentSpec):
        return generate_agents(n_requests, seed=seed, spec=spec)
    if isinstance(spec, RagSpec):
        return generate_rag(n_requests, seed=seed, spec=spec)
    return generate_conversations(n_requests, seed=seed, spec=spec)


def generate_agents(
    n_requests: int, *, seed: int = 0, spec: AgentSpec | None = None, **params: Any
) -> list[Request]:
    """`n_requests` requests of agent sessions, in arrival order (see the module's doc).
    Parameters are those of `AgentSpec`, as keywords or `spec`."""
    return _AgentGenerator(_spec(n_requests, spec or AgentSpec(), params), seed).run(n_requests)


def generate_rag(
    n_requests: int, *, seed: int = 0, spec: RagSpec | None = None, **params: Any
) -> list[Request]:
    """`n_requests` RAG queries, in arrival order (see the module's doc). Parameters
    are those of `RagSpec`, as keywords or `spec`."""
    return _RagGenerator(_spec(n_requests, spec or RagSpec(), params), seed).run(n_requests)


def _spec(n_requests: int, spec: Any, params: dict[str, Any]) -> Any:
    """`spec` with `params` over it; a negative request count is refused."""
    if n_requests < 0:
        raise ValueError(f"n_requests must be >= 0, got {n_requests}")
    return _replace(spec, params) if params else spec


def _replace(spec: Any, params: dict[str, Any]) -> Any:
    cls = type(spec)
    known = set(cls.__dataclass_fields__)
    unknown = set(params) - known
    if unknown:
        raise TypeError(f"unknown workload parameter(s): {', '.join(sorted(unknown))}")
    return cls(**{**{k: getattr(spec, k) for k in known}, **params})


class _PrefixIds:
    """Block ids from a trie: the id of a block is fixed by its parent id and content."""

    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {}  # (parent id, content) -> id
        self._addressed: dict[Hashable, int] = {}  # content -> id
        self._next = itertools.count()

    def chain(self, contents: Sequence[Hashable],
              addressed: Callable[[Hashable], bool] | None = None) -> tuple[int, ...]:
        """The ids of `contents` as one prefix chain; a content for which `addressed`
        is true keeps one id wherever it appears (content-addressed blocks)."""
        ids = []
        parent = -1
        for content in contents:
            table, node = ((self._addressed, content)
                           if addressed is not None and addressed(content)
                           else (self._ids, (parent, content)))
            block = table.get(node)
            if block is None:
                block = table[node] = next(self._next)
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


class _Sessions:
    """What every generator keeps: its spec, its random stream, the block ids, and
    the counters of sessions and requests."""

    def __init__(self, spec: Any, seed: int) -> None:
        self.spec = spec
        self.rng = random.Random(seed)
        self.ids = _PrefixIds()
        self.serials = itertools.count()
        self.requests = itertools.count()

    def _span(self, span: Span) -> int:
        return self.rng.randint(span[0], span[1])

    def _turns(self, mean: float) -> int:
        """A geometric number of turns with this mean (at least one)."""
        turns = 1
        while self.rng.random() > 1.0 / mean:
            turns += 1
        return turns

    def _request(self, hash_ids: tuple[int, ...], now: float, max_output: int) -> Request:
        """The request of these blocks, its last one partly filled."""
        rng = self.rng
        input_length = len(hash_ids) * MOONCAKE_BLOCK_TOKENS - rng.randrange(MOONCAKE_BLOCK_TOKENS)
        return Request(round(now * 1000.0, 3), max(input_length, 1), rng.randint(16, max_output),
                       hash_ids)

    def _sessions_run(self, n_requests: int, sessions: int,
                      one_off_share: float = 0.0) -> list[Request]:
        """`sessions` sessions open at once, each replaced when it ends; the one that
        speaks next is the earliest on the agenda, after a think time of its pace."""
        rng = self.rng
        # (next turn time, tiebreak, conversation): the conversation that speaks next.
        agenda: list[tuple[float, int, _Conversation]] = []
        for _ in range(sessions):
            conv = self._open()
            heapq.heappush(agenda, (rng.expovariate(1.0 / conv.pace), conv.serial, conv))
        out: list[Request] = []
        now = 0.0
        while len(out) < n_requests:
            if one_off_share and rng.random() < one_off_share:
                out.append(self._one_off(now))
                continue
            now, _, conv = heapq.heappop(agenda)
            out.append(self._turn(conv, now))
            if conv.turns_left == 0:
                conv = self._open()
            heapq.heappush(agenda, (now + rng.expovariate(1.0 / conv.pace), conv.serial, conv))
        return out

    def _open(self) -> _Conversation:
        raise NotImplementedError

    def _turn(self, conv: _Conversation, now: float) -> Request:
        raise NotImplementedError

    def _one_off(self, now: float) -> Request:
        raise NotImplementedError


class _Generator(_Sessions):
    def __init__(self, spec: WorkloadSpec, seed: int) -> None:
        super().__init__(spec, seed)
        self.prompt_weights = _zipf_cumulative(spec.system_prompts, spec.zipf)
        self.doc_weights = _zipf_cumulative(max(spec.documents, 1), spec.zipf)
        self.doc_lengths = [self._span(spec.document_blocks) for _ in range(spec.documents)]

    def run(self, n_requests: int) -> list[Request]:
        return self._sessions_run(n_requests, self.spec.conversations, self.spec.one_off_share)

    def _open(self) -> _Conversation:
        spec, rng = self.spec, self.rng
        serial = next(self.serials)
        turns = self._turns(spec.turns)
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
        return self._request(self.ids.chain(contents), now, 1024)

    def _one_off(self, now: float) -> Request:
        serial = next(self.requests)
        contents = [("once", serial, i) for i in range(self._span(self.spec.one_off_blocks))]
        return self._request(self.ids.chain(contents), now, 1024)


def _zipf_cumulative(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))


def _draw(rng: random.Random, cumulative: list[float]) -> int:
    return bisect.bisect_right(cumulative, rng.random() * cumulative[-1])


def _lognormal_mean(sigma: float) -> float:
    return math.exp(sigma * sigma / 2.0)


class _AgentGenerator(_Sessions):
    """Agent sessions on a real-time clock (seconds)."""

    def __init__(self, spec: AgentSpec, seed: int) -> None:
        super().__init__(spec, seed)
        self.type_weights = _zipf_cumulative(spec.agent_types, spec.zipf)
        self.prompt_lengths = [self._span(spec.prompt_blocks) for _ in range(spec.agent_types)]
        # Little's law: sessions last about steps * (decode + tool) seconds.
        tool_mean = spec.tool_seconds * _lognormal_mean(spec.tool_spread)
        self.open_rate = spec.agents / (spec.steps * (spec.decode_seconds + tool_mean))

    def run(self, n_requests: int) -> list[Request]:
        rng = self.rng
        agenda: list[tuple[float, int, _Conversation]] = []
        now = 0.0
        for _ in range(self.spec.agents):  # a warm start: sessions already under way
            conv = self._open()
            heapq.heappush(agenda, (rng.uniform(0.0, 1.0 / self.open_rate), conv.serial, conv))
        next_open = rng.expovariate(self.open_rate)
        out: list[Request] = []
        while len(out) < n_requests:
            if next_open < agenda[0][0]:
                conv = self._open()
                heapq.heappush(agenda, (next_open, conv.serial, conv))
                next_open += rng.expovariate(self.open_rate)
                continue
            now, _, conv = heapq.heappop(agenda)
            out.append(self._step(conv, now))
            if conv.turns_left > 0:
                later = now + rng.expovariate(1.0 / self.spec.decode_seconds) + (
                    self.spec.tool_seconds * rng.lognormvariate(0.0, self.spec.tool_spread))
                heapq.heappush(agenda, (later, conv.serial, conv))
        return out

    def _open(self) -> _Conversation:
        spec, rng = self.spec, self.rng
        serial = next(self.serials)
        conv = _Conversation(serial, self._turns(spec.steps), 0.0)
        kind = _draw(rng, self.type_weights)
        conv.history = [("agent", kind, i) for i in range(self.prompt_lengths[kind])]
        conv.history += [("task", serial, i) for i in range(self._span(spec.task_blocks))]
        return conv

    def _step(self, conv: _Conversation, now: float) -> Request:
        spec, rng = self.spec, self.rng
        contents = conv.history + [("tail", next(self.requests))]
        call = [("call", conv.serial, conv.turn, i) for i in range(self._span(spec.call_blocks))]
        length = round(spec.result_blocks * rng.lognormvariate(0.0, spec.result_spread))
        result = [("result", conv.serial, conv.turn, i)
                  for i in range(max(1, min(length, spec.max_result_blocks)))]
        conv.history = conv.history + call + result
        conv.turn += 1
        conv.turns_left -= 1
        return self._request(self.ids.chain(contents), now, 512)


class _RagGenerator(_Sessions):
    """RAG sessions: shared prompt, retrieved passages, questions (request slots)."""

    def __init__(self, spec: RagSpec, seed: int) -> None:
        super().__init__(spec, seed)
        self.prompt_weights = _zipf_cumulative(spec.system_prompts, 1.0)
        self.doc_weights = _zipf_cumulative(spec.documents, spec.zipf)
        self.doc_lengths = [self._span(spec.chunk_blocks) for _ in range(spec.documents)]

    def run(self, n_requests: int) -> list[Request]:
        return self._sessions_run(n_requests, self.spec.sessions)

    def _open(self) -> _Conversation:
        spec, rng = self.spec, self.rng
        serial = next(self.serials)
        turns = self._turns(spec.turns)
        conv = _Conversation(serial, turns, spec.sessions * rng.lognormvariate(0.0, 1.0)
                             / _lognormal_mean(1.0))
        prompt = _draw(rng, self.prompt_weights)
        conv.history = [("sys", prompt, i) for i in range(spec.system_prompt_blocks)]
        docs: list[int] = []
        for _ in range(self._span(spec.chunks)):
            doc = _draw(rng, self.doc_weights)
            if doc in docs and not (spec.ids == "content" and rng.random() < spec.repeat_share):
                continue  # a retriever returns a passage once, barring the odd duplicate
            docs.append(doc)
        if spec.sorted_chunks:
            docs.sort()
        for doc in docs:
            conv.history += [("doc", doc, i) for i in range(self.doc_lengths[doc])]
        return conv

    def _turn(self, conv: _Conversation, now: float) -> Request:
        spec = self.spec
        question = [("q", conv.serial, conv.turn, i)
                    for i in range(self._span(spec.question_blocks))]
        contents = conv.history + question + [("tail", next(self.requests))]
        answer = [("a", conv.serial, conv.turn, i) for i in range(self._span(spec.answer_blocks))]
        conv.history = conv.history + question + answer
        conv.turn += 1
        conv.turns_left -= 1
        # Content ids: passage and prompt blocks keep one id wherever they appear.
        addressed = _passage_or_prompt if spec.ids == "content" else None
        return self._request(self.ids.chain(contents, addressed), now, 512)


def _passage_or_prompt(content: Hashable) -> bool:
    return isinstance(content, tuple) and content[0] in ("doc", "sys")
