"""The engine's own prefill rate, measured from its scheduler's steps.

The load-or-recompute rule (`tierkv.core.costs`) weighs a promotion against the
time this engine would take to compute the same tokens, so the connector tells
the broker, with every lookup, what a token costs here. It is measured, not
configured: each scheduler step's tokens (`total_num_scheduled_tokens`) and the
time until the next step is scheduled give a point of `seconds = overhead + tokens
/ rate`, fitted as a tier's line is (decode steps pin the overhead, prefill steps
the rate). An interval counts only when some request runs through both steps: one
that spans an idle engine says nothing of its speed.

Until measured the rate is `DEFAULT_PREFILL_TPS` (an H100-class figure for an 8B
model; a slower engine is measured within its first steps). `prefill_tokens_per_s`
in `kv_connector_extra_config` fixes it instead, and 0 turns the rule off (every
promotion goes, whatever it costs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tierkv.core.costs import LinearCost

DEFAULT_PREFILL_TPS = 10_000.0
STEP_OVERHEAD_S = 0.005  # the prior's fixed cost of a step
REFERENCE_TOKENS = 1024  # the prior's second point
MIN_TPS, MAX_TPS = 10.0, 1e8


class PrefillRate:
    """Tokens per second this engine computes, kept current from its steps."""

    def __init__(self, fixed_tps: float | None = None,
                 default_tps: float = DEFAULT_PREFILL_TPS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if fixed_tps is not None and fixed_tps < 0:
            raise ValueError(f"prefill_tokens_per_s must be >= 0, got {fixed_tps}")
        self.fixed = fixed_tps
        self.line = LinearCost(STEP_OVERHEAD_S, default_tps, reference_bytes=REFERENCE_TOKENS,
                               min_bandwidth=MIN_TPS, max_bandwidth=MAX_TPS)
        self._clock = clock
        self._last: tuple[float, int, frozenset[str]] | None = None  # (when, tokens, requests)

    @property
    def tokens_per_s(self) -> float:
        """The rate lookups are sent with (0: the rule is off)."""
        return self.line.bandwidth if self.fixed is None else self.fixed

    def scheduled(self, scheduler_output: Any) -> None:
        """A scheduler step was built: the previous one has run."""
        if self.fixed is not None:
            return
        now = self._clock()
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        requests = frozenset(getattr(scheduler_output, "num_scheduled_tokens", None) or ())
        last = self._last
        if last is not None and last[2] & requests:
            self.line.observe(last[1], now - last[0])
        self._last = (now, tokens, requests) if tokens > 0 else None

    def as_dict(self) -> dict[str, Any]:
        if self.fixed is not None:
            return {"tokens_per_s": self.fixed, "measured": False}
        return {"tokens_per_s": round(self.line.bandwidth, 1),
                "step_overhead_ms": round(self.line.latency_s * 1e3, 3),
                "samples": self.line.samples, "measured": self.line.samples > 0}
