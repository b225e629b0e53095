"""The S3 tier's circuit breaker: once the endpoint has failed enough requests in a
row, jobs fail at once and existence checks miss, so a dead endpoint costs no
deadlines; after a cool-down one trial request decides whether it closes again."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tierkv.s3")


class CircuitBreaker:
    """CLOSED → (n final failures in a row) → OPEN → (cool-down) → HALF_OPEN, where
    one trial request decides between CLOSED and OPEN again. Thread-safe."""

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, failures: int, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("breaker_failures must be >= 1 and breaker_cooldown_s > 0")
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = self.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial = False
        self.opens = 0

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def retry_in(self) -> float:
        with self._lock:
            return max(0.0, self._opened_at + self.cooldown_s - self._clock())

    def allow(self) -> bool:
        """May a request go out now? In HALF_OPEN only the one trial may."""
        with self._lock:
            if self._state == self.OPEN and self._clock() >= self._opened_at + self.cooldown_s:
                self._state, self._trial = self.HALF_OPEN, False
            if self._state == self.CLOSED:
                return True
            if self._state == self.HALF_OPEN and not self._trial:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            if self._state != self.CLOSED:
                log.info("s3 endpoint answers again: circuit closed")
            self._state, self._failures, self._trial = self.CLOSED, 0, False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state == self.HALF_OPEN or (
                self._state == self.CLOSED and self._failures >= self.threshold
            ):
                self._state, self._opened_at, self._trial = self.OPEN, self._clock(), False
                self.opens += 1
                log.warning("s3 endpoint failed %d times in a row: circuit open for %.1fs",
                            self._failures, self.cooldown_s)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            retry_in = max(0.0, self._opened_at + self.cooldown_s - self._clock())
            return {"breaker": self._state, "breaker_opens": self.opens,
                    "consecutive_failures": self._failures,
                    "breaker_retry_in_s": retry_in if self._state == self.OPEN else 0.0}
