"""Workloads of shared prefixes for a real engine (`tierkv.demo.vllm_process`), as
rounds of requests in its protocol: prompts are token ids, drawn from a seed.

* `documents`: questions about documents: every request is a whole document (whole
  KV blocks of it) and a question of its own; a document's questions fall in
  different rounds, so the later ones can reuse its KV, from the engine's own cache
  or, once the engine has evicted it, from tierkv.
* `chats`: multi-turn conversations sharing one system prompt: round t holds turn t
  of every conversation, whose prompt is the conversation so far (every earlier
  prompt and answer) and the user's new message.
* `mixed`: both, round by round.
"""

from __future__ import annotations

import random
from typing import Any

Round = list[dict[str, Any]]
LOW, HIGH = 3, 1000  # token ids drawn from [LOW, HIGH): no special tokens of the model


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW, HIGH) for _ in range(n)]


def documents(docs: int, doc_blocks: int, questions: int, block_size: int = 32,
              seed: int = 0, question_seed: int | None = None,
              question_tokens: tuple[int, int] = (8, 40)) -> list[Round]:
    """`questions` rounds; each asks every document one new question. The documents
    are drawn from `seed`, the questions from `question_seed` (default: `seed`)."""
    rng = random.Random(f"documents/{seed}")
    texts = [_tokens(rng, doc_blocks * block_size) for _ in range(docs)]
    asked = random.Random(f"questions/{seed if question_seed is None else question_seed}")
    return [[{"prompt": text + _tokens(asked, asked.randint(*question_tokens))}
             for text in texts] for _ in range(questions)]


def chats(conversations: int, turns: int, system_blocks: int = 2, block_size: int = 32,
          seed: int = 0, user_tokens: tuple[int, int] = (24, 72), tag: str = "c"
          ) -> list[Round]:
    """`turns` rounds of `conversations` conversations (named `tag` + number): the
    first turn starts with the shared system prompt."""
    rng = random.Random(f"chats/{seed}")
    system = _tokens(rng, system_blocks * block_size)
    out: list[Round] = []
    for turn in range(turns):
        head = system if turn == 0 else []
        out.append([{"chat": f"{tag}{c}", "user": head + _tokens(rng, rng.randint(*user_tokens))}
                    for c in range(conversations)])
    return out


def mixed(*workloads: list[Round]) -> list[Round]:
    """The workloads' rounds merged: round i holds round i of each."""
    merged: list[Round] = []
    for rounds in workloads:
        for i, requests in enumerate(rounds):
            if i == len(merged):
                merged.append([])
            merged[i].extend(requests)
    return merged
