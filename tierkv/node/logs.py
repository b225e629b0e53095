"""One log format for every process: time, [component], pid, level, message.

The supervisor keeps each child's recent lines, so a child logs to stderr only.
Secrets never reach a log line: components log names of things, not values of
credentials, and `redact` masks a known secret where a foreign message is logged.

A peer's bad input must not fill the disk through the log: every value that came
from outside is logged through `foreign` (a short prefix and its length), and
warnings that a peer can trigger at will go through a `RateLimitedLog`, which
writes the first of a kind and then at most one line per interval with the count
of what it held back.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

FORMAT = "%(asctime)s [%(component)s] pid=%(process)d %(levelname)s %(name)s: %(message)s"


class _ComponentFilter(logging.Filter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def filter(self, record: logging.LogRecord) -> bool:
        record.component = self.component
        return True


def setup_logging(component: str, level: str | int = "info", verbose: int = 0) -> None:
    """Configure the root logger of this process (idempotent)."""
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    if verbose:
        level = min(level, logging.DEBUG)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_tierkv", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._tierkv = True  # type: ignore[attr-defined]
    handler.addFilter(_ComponentFilter(component))
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    # Third-party chatter (boto's request logs can include signed headers).
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def redact(text: str, *secrets: str | None) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


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

