"""Log lines a peer cannot blow up: a foreign value is logged as a short prefix with
its length (`foreign`), and a warning a peer can trigger at will goes through a
`RateLimitedLog`, which writes the first of a kind and then at most one line per
interval, with the count of what it held back."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

FOREIGN_CHARS = 120  # of a foreign value in a log line


def foreign(value: object, limit: int = FOREIGN_CHARS) -> str:
    """A value that came from a peer or a client, fit for a log line: its repr cut to
    `limit` characters, with the full length when it was cut."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} chars)"


class RateLimitedLog:
    """At most one line per `key` (e.g. peer and cause) every `interval_s`; the line
    that ends a quiet spell says how many were held back. Keys are bounded
    (`max_keys`, oldest forgotten first), so a flood of new identities cannot grow it."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 max_keys: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._clock = clock
        self._seen: OrderedDict[Hashable, list[float]] = OrderedDict()  # key -> [last, held]
        self.suppressed = 0  # lines held back in all

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Log unless `key` logged within the interval; True if a line was written."""
        now = self._clock()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.interval_s:
            entry[1] += 1
            self.suppressed += 1
            return False
        held = int(entry[1]) if entry is not None else 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        if held:
            msg += " (%d more like it in the last %.0fs)"
            args = (*args, held, self.interval_s)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

