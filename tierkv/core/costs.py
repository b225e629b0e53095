"""What a load from each tier costs, against what recomputing costs the engine.

A promotion from a secondary tier is worth starting only if its blocks are expected
in the CPU tier sooner than the engine could recompute them. Both sides are
measured, never assumed for long:

* **A tier's cost** is a line, `seconds = latency + bytes / bandwidth`, where
  `bytes` counts the promotion's own blocks and those queued ahead of it on the
  same tier (a queue drains at the tier's bandwidth). `LinearCost` fits it online
  from every promotion's (bytes, seconds) by least squares that forgets old samples
  (`half_life` samples), starting from a prior (a per-type default, or the tier's
  `load_latency_ms`/`load_bandwidth_mb_s`) that it keeps as a faint anchor, so
  that samples of one size still give a line. A sample far above the line is
  clipped to `OUTLIER_FACTOR` times it: one stray stall moves the estimate a
  little; each further one in a row may be that factor higher again, and from the
  third sample in a row that far off the line (above or below) the old samples
  are mostly forgotten: a tier that really changed speed is followed within a few
  samples.
* **A stall is seen before it ends**: a tier whose oldest promotion has been out
  for longer than the line says is slow at least by that age (`TierCosts.eta`),
  so new requests stop choosing it at once, not once the stuck job times out.
* **Recomputing** costs `seconds_per_key` per key (the engine's prefill rate and
  the tokens a key covers), or a request's own budget.

`best_split` chooses how much of a request's leading run to load: the prefix that
minimises the expected wait for its loads plus the recompute of the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Until measured: a conservative line per tier type (seconds, bytes per second).
# Slow enough that a cold tier is not trusted over a fast engine, fast enough that
# it is chosen where recomputing is clearly slower, and measured from then on.
DEFAULT_COSTS: dict[str, tuple[float, float]] = {
    "memory": (0.001, 2e9),
    "disk": (0.005, 500e6),
    "s3": (0.050, 100e6),
}
UNKNOWN_TYPE_COST = (0.020, 200e6)
HALF_LIFE_SAMPLES = 32.0  # a sample's weight halves after this many newer ones
PRIOR_WEIGHT = 0.25  # the prior's lasting weight (a sample's is 1)
OUTLIER_FACTOR = 4.0  # a sample counts at most this many times the line's prediction
CHANGE_STREAK = 3  # samples this far off the line in a row: the tier changed speed
CHANGE_FORGET = 0.25  # what is kept of the old samples per such sample
MIN_BANDWIDTH = 1e3  # bytes/s: a floor, so a line never divides by zero
MAX_BANDWIDTH = 1e12
# A request waits for its promotions at most its recompute time times this, plus
# `WAIT_SLACK_S` (the engine's and the broker's step granularity).
WAIT_MARGIN = 1.25
WAIT_SLACK_S = 0.020


class LinearCost:
    """`seconds = latency + bytes / bandwidth`, fitted online (see the module doc)."""

    def __init__(self, latency_s: float, bandwidth: float,
                 half_life: float = HALF_LIFE_SAMPLES, prior_weight: float = PRIOR_WEIGHT,
                 reference_bytes: float = 1 << 20, min_bandwidth: float = MIN_BANDWIDTH,
                 max_bandwidth: float = MAX_BANDWIDTH) -> None:
        """`bandwidth` is in units of what `observe` counts (bytes; tokens for an
        engine's prefill) per second, kept within [`min_bandwidth`, `max_bandwidth`]."""
        if not (latency_s >= 0 and math.isfinite(latency_s)):
            raise ValueError(f"latency must be a finite number >= 0, got {latency_s}")
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
        self.prior = (latency_s, bandwidth)
        self._slopes = (1.0 / max_bandwidth, 1.0 / min_bandwidth)
        self._keep = 0.5 ** (1.0 / half_life)
        # The prior as two points of the line (at no bytes and at a reference size),
        # kept at a small weight that never decays.
        x1 = float(reference_bytes)
        self._prior_sums = self._point_sums(
            [(0.0, latency_s), (x1, latency_s + x1 / bandwidth)], prior_weight / 2)
        self._sums = [0.0] * 5  # decayed sums of w, wx, wy, wxx, wxy of the samples
        self.samples = 0
        self.clipped = 0
        self._streak = 0  # samples clipped in a row
        self.latency_s, self.bandwidth = latency_s, bandwidth

    @staticmethod
    def _point_sums(points: Sequence[tuple[float, float]], weight: float) -> list[float]:
        sums = [0.0] * 5
        for x, y in points:
            for i, v in enumerate((1.0, x, y, x * x, x * y)):
                sums[i] += weight * v
        return sums

    def predict(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth

    def observe(self, nbytes: float, seconds: float) -> None:
        """One measured job: `nbytes` (its own and those queued ahead) took `seconds`."""
        if not (nbytes >= 0 and seconds >= 0 and math.isfinite(seconds)):
            return
        predicted = self.predict(nbytes)
        ceiling = OUTLIER_FACTOR ** (1 + self._streak) * predicted
        surprise = seconds > OUTLIER_FACTOR * predicted or seconds * OUTLIER_FACTOR < predicted
        if seconds > ceiling:
            seconds = ceiling
            self.clipped += 1
        self._streak = min(self._streak + 1, 8) if surprise else 0
        keep = self._keep if self._streak < CHANGE_STREAK else self._keep * CHANGE_FORGET
        s = self._sums
        x, y = float(nbytes), float(seconds)
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = s[i] * keep + v
        self.samples += 1
        self._fit()

    def _fit(self) -> None:
        w, sx, sy, sxx, sxy = (a + b for a, b in zip(self._sums, self._prior_sums, strict=True))
        mean_x, mean_y = sx / w, sy / w
        var = sxx / w - mean_x * mean_x
        cov = sxy / w - mean_x * mean_y
        low, high = self._slopes
        slope = cov / var if var > 0 else 1.0 / self.bandwidth
        slope = min(max(slope, low), high)
        latency = mean_y - slope * mean_x
        if latency < 0:  # the line through the origin, fitted to the same points
            latency = 0.0
            slope = min(max(sxy / sxx if sxx > 0 else slope, low), high)
        self.latency_s, self.bandwidth = latency, 1.0 / slope

    def as_dict(self) -> dict[str, float]:
        return {"latency_ms": round(self.latency_s * 1e3, 3),
                "bandwidth_mb_s": round(self.bandwidth / 1e6, 3),
                "samples": self.samples, "outliers_clipped": self.clipped}


def prior_for(tier_type: str, latency_ms: float = 0.0,
              bandwidth_mb_s: float = 0.0) -> tuple[float, float]:
    """A tier's starting line: its config's figures where given, else its type's."""
    latency_s, bandwidth = DEFAULT_COSTS.get(tier_type, UNKNOWN_TYPE_COST)
    if latency_ms > 0:
        latency_s = latency_ms / 1e3
    if bandwidth_mb_s > 0:
        bandwidth = bandwidth_mb_s * 1e6
    return latency_s, bandwidth


class TierCosts:
    """One tier's line and what it has in flight (promotions: bytes and start times)."""

    def __init__(self, latency_s: float, bandwidth: float) -> None:
        self.line = LinearCost(latency_s, bandwidth)
        self.queued_bytes = 0  # bytes of promotions submitted and not yet finished
        self._started: dict[int, tuple[float, int, int]] = {}  # job -> (t0, bytes, ahead)

    def started(self, job_id: int, now: float, nbytes: int) -> None:
        self._started[job_id] = (now, nbytes, self.queued_bytes)
        self.queued_bytes += nbytes

    def finished(self, job_id: int, now: float, landed: bool) -> float | None:
        """A promotion ended: learn from it (a failure only if it was slow, which is
        news; one that failed fast says nothing of the tier's speed). Returns how
        long it took, None if it was not known."""
        entry = self._started.pop(job_id, None)
        if entry is None:
            return None
        t0, nbytes, ahead = entry
        self.queued_bytes = max(0, self.queued_bytes - nbytes)
        seconds = now - t0
        if landed or seconds > self.line.predict(ahead + nbytes):
            self.line.observe(ahead + nbytes, seconds)
        return seconds

    def oldest_age(self, now: float) -> float:
        if not self._started:
            return 0.0
        return now - min(t0 for t0, _, _ in self._started.values())

    def eta(self, nbytes: int, now: float) -> float:
        """Expected seconds for a new promotion of `nbytes` submitted now, behind what
        is queued, and no sooner than the oldest job out there has already taken."""
        line = self.line
        queued = line.predict(self.queued_bytes + nbytes)
        if not self._started:
            return queued
        return max(queued, self.oldest_age(now) + nbytes / line.bandwidth)

    def remaining(self, job_id: int, now: float) -> float:
        """Expected seconds left of an in-flight promotion (its age counts: one past
        its prediction is expected to take as long again as it has)."""
        entry = self._started.get(job_id)
        if entry is None:
            return 0.0
        t0, nbytes, ahead = entry
        age = now - t0
        left = self.line.predict(ahead + nbytes) - age
        return left if left > 0 else age

    def as_dict(self, now: float) -> dict[str, float]:
        return {**self.line.as_dict(), "queued_bytes": self.queued_bytes,
                "oldest_promotion_s": round(self.oldest_age(now), 3)}


@dataclass(frozen=True, slots=True)
class Recompute:
    """What recomputing costs the request asking: seconds per key (its engine's
    prefill), and optionally a budget of its own (the longest it waits for loads)."""

    seconds_per_key: float
    budget_s: float | None = None

    def seconds(self, keys: int) -> float:
        return keys * self.seconds_per_key

    def wait_bound(self, keys: int) -> float:
        """The longest a request waits for `keys` being promoted for it."""
        if self.budget_s is not None:
            return self.budget_s + WAIT_SLACK_S
        return self.seconds(keys) * WAIT_MARGIN + WAIT_SLACK_S


def recompute_for(prefill_tps: float, key_tokens: int,
                  budget_s: float | None = None) -> Recompute | None:
    """The rule's input from what an engine says (None: it said nothing to weigh)."""
    if budget_s is not None:
        per_key = key_tokens / prefill_tps if prefill_tps > 0 and key_tokens > 0 else 0.0
        return Recompute(per_key, budget_s)
    if prefill_tps > 0 and key_tokens > 0:
        return Recompute(key_tokens / prefill_tps)
    return None


def best_split(arrivals: Sequence[float], recompute: Recompute) -> tuple[int, float]:
    """How many leading keys of a run to load, given each key's expected arrival
    (seconds from now; 0 for one already readable, in order): the prefix `m` that
    minimises `max(arrivals[:m]) + recompute of the rest`, and that wait. With a
    budget, the longest prefix whose wait fits in it (then its recompute is the
    budget's to judge)."""
    n = len(arrivals)
    if recompute.budget_s is not None:
        wait = best = 0.0
        m = 0
        for i, arrival in enumerate(arrivals):
            wait = max(wait, arrival)
            if wait > recompute.budget_s:
                break
            m, best = i + 1, wait
        return m, best
    per_key = recompute.seconds_per_key
    best_m, best_cost, best_wait = 0, n * per_key, 0.0
    wait = 0.0
    for i, arrival in enumerate(arrivals):
        if arrival > wait:
            wait = arrival
        cost = wait + (n - i - 1) * per_key
        if cost < best_cost:  # strictly: a tie recomputes (no wait, no load)
            best_m, best_cost, best_wait = i + 1, cost, wait
    return best_m, best_wait
