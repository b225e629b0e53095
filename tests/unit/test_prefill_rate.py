"""The engine's prefill rate as `tierkv.vllm` measures it from its scheduler's steps:
what the load-or-recompute rule weighs every promotion against."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tierkv.vllm.prefill import DEFAULT_PREFILL_TPS, PrefillRate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(tokens: dict[str, int]) -> SimpleNamespace:
    """What the rate reads of vLLM's `SchedulerOutput`."""
    return SimpleNamespace(num_scheduled_tokens=tokens,
                           total_num_scheduled_tokens=sum(tokens.values()))


def run(rate: PrefillRate, clock: Clock, steps: list[dict[str, int]], overhead: float,
        tps: float) -> None:
    for tokens in steps:
        rate.scheduled(step(tokens))
        clock.now += overhead + sum(tokens.values()) / tps


def test_until_measured_the_documented_default():
    assert PrefillRate().tokens_per_s == pytest.approx(DEFAULT_PREFILL_TPS)
    assert PrefillRate(fixed_tps=1234.0).tokens_per_s == 1234.0
    assert PrefillRate(fixed_tps=0.0).tokens_per_s == 0.0  # the rule off
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        PrefillRate(fixed_tps=-1.0)


def test_prefill_and_decode_steps_give_the_rate_and_the_step_overhead():
    clock = Clock()
    rate = PrefillRate(clock=clock)
    # A CPU engine: 3,000 tokens/s and 20 ms a step; requests prefill in chunks
    # of 512, then decode a token a step, always some request running through.
    steps = []
    for i in range(20):
        steps.append({"a": 1, f"new{i}": 512})
        steps += [{"a": 1, f"new{i}": 1}] * 3
    run(rate, clock, steps, overhead=0.020, tps=3000.0)
    assert rate.tokens_per_s == pytest.approx(3000.0, rel=0.1)
    assert rate.line.latency_s == pytest.approx(0.020, rel=0.2)
    assert rate.as_dict()["measured"]


def test_an_idle_gap_between_steps_is_not_taken_for_a_slow_step():
    clock = Clock()
    rate = PrefillRate(clock=clock)
    for i in range(10):
        run(rate, clock, [{f"r{i}": 256}, {f"r{i}": 1}], overhead=0.01, tps=20_000.0)
        clock.now += 30.0  # nothing to do for half a minute, then a new request
    assert rate.tokens_per_s > 5_000.0


def test_a_fixed_rate_is_not_measured():
    clock = Clock()
    rate = PrefillRate(fixed_tps=500.0, clock=clock)
    run(rate, clock, [{"a": 100}] * 10, overhead=0.0, tps=10_000.0)
    assert rate.tokens_per_s == 500.0 and rate.line.samples == 0
