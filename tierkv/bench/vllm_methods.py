"""`tierkv bench vllm --by-method`: where each back end's scheduler-side time goes.

The step's figure says how much tierkv costs against vLLM's own manager, not where:
this times every call vLLM makes into an `OffloadingManager` (the methods of vLLM's
abstract class, outermost call only: a method calling another counts once), per
back end, over the timed steps, and prints them side by side. What is left of a
step outside the manager is vLLM's own work, and whatever the node's processes
take from the engine's core on a loaded machine.
"""

from __future__ import annotations

import functools
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

    def attach(self, manager: Any) -> None:
        """Time `manager`'s calls from now on (its own attributes: the class and
        every other instance are left as they are)."""
        for name in manager_methods():
            method = getattr(manager, name, None)
            if callable(method):
                setattr(manager, name, self._wrap(name, method))

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
