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

from tierkv.core.loglimit import FOREIGN_CHARS, RateLimitedLog, foreign

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


__all__ = ["FOREIGN_CHARS", "FORMAT", "RateLimitedLog", "foreign", "redact", "setup_logging"]
