"""`tierkv bench vllm --by-method`: where each back end's scheduler-side time goes.

The step's figure says how much tierkv costs against vLLM's own manager, not where:
this times every call vLLM makes into an `OffloadingManager` (the methods of vLLM's
abstract class, outermost call only: a method calling another counts once), per
back end, over the timed steps, and prints them side by side. What is left of a
step outside the manager is vLLM's own work, and whatever the node's processes
take from the engine's core on a loaded machine. Both back ends run the same steps
(the workload is seeded), so step i of one is paired with step i of the other: the
median of their differences splits the step's gap into the manager's calls and the
rest (`paired`), where a ratio of medians cannot.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any


def manager_methods() -> list[str]:
    """The public methods of vLLM's `OffloadingManager` (what a scheduler calls)."""
    from vllm.v1.kv_offload.base import OffloadingManager

    return sorted(name for name, value in vars(OffloadingManager).items()
                  if not name.startswith("_") and callable(value))


class MethodTimes:
    """Seconds and calls per method, counted while `counting` is set."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.counting = False
        self._depth = 0
        self.per_step: list[float] = []  # the calls' seconds in each timed step
        self._step_start = 0.0

    def attach(self, manager: Any) -> None:
        """Time `manager`'s calls from now on (its own attributes: the class and
        every other instance are left as they are)."""
        for name in manager_methods():
            method = getattr(manager, name, None)
            if callable(method):
                setattr(manager, name, self._wrap(name, method))

    def begin_step(self) -> None:
        """A timed step starts (calls before it, the adds', are not its own)."""
        self._step_start = sum(self.seconds.values())

    def end_step(self) -> None:
        self.per_step.append(sum(self.seconds.values()) - self._step_start)

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth or not self.counting:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
                self._depth -= 1

        return timed


def report(ours: MethodTimes, theirs: MethodTimes, steps: int) -> list[str]:
    """Lines of ms and calls per timed step, per method, busiest first."""
    names = sorted(set(ours.seconds) | set(theirs.seconds),
                   key=lambda n: -max(ours.seconds[n], theirs.seconds[n]))
    lines = [f"by method, per timed step ({steps} steps): ms (calls)   tierkv | vLLM"]
    for name in names:
        lines.append(f"  {name:28s} {ours.seconds[name] / steps * 1e3:7.3f} "
                     f"({ours.calls[name] / steps:5.1f}) | "
                     f"{theirs.seconds[name] / steps * 1e3:7.3f} "
                     f"({theirs.calls[name] / steps:5.1f})")
    lines.append(f"  {'all':28s} {sum(ours.seconds.values()) / steps * 1e3:7.3f}"
                 f"         | {sum(theirs.seconds.values()) / steps * 1e3:7.3f}")
    return lines


def paired(ours: list[float], our_calls: MethodTimes, theirs: list[float],
           their_calls: MethodTimes) -> str:
    """The step's gap, step by step: medians of tierkv's step minus vLLM's, of the
    same for the manager's calls, and for the rest of the step (vLLM's own code)."""
    def median_ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:+.3f} ms"

    calls = [a - b for a, b in zip(our_calls.per_step, their_calls.per_step, strict=True)]
    steps = [a - b for a, b in zip(ours, theirs, strict=True)]
    return (f"paired, the same steps, median of tierkv minus vLLM: step {median_ms(steps)}, "
            f"manager calls {median_ms(calls)}, "
            f"the rest {median_ms([s - c for s, c in zip(steps, calls, strict=True)])}")
