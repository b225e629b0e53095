"""One log format for every process: time, [component], pid, level, message.

A child logs to stderr only; its supervisor reads every line (`read_lines`, each
cut to `LINE_BYTES`), keeps the recent ones for error reports, echoes them, and
writes them with its own lines to the node's log on disk (`NodeLog`): rotating
files in the run directory, so the log takes at most `log_file_count` x
`log_file_bytes` however much anything writes. A disk filled by log lines is a
node that stops.
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
import logging.handlers
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

FORMAT = "%(asctime)s [%(component)s] pid=%(process)d %(levelname)s %(name)s: %(message)s"


class _ComponentFilter(logging.Filter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def filter(self, record: logging.LogRecord) -> bool:
        record.component = self.component
        return True


_component = "tierkv"  # this process's, for records that reach a handler of ours


def setup_logging(component: str, level: str | int = "info", verbose: int = 0) -> None:
    """Configure the root logger of this process (idempotent)."""
    global _component
    _component = component
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


# -- the node's log on disk ------------------------------------------------------------

LINE_BYTES = 4096  # of one line a child writes, kept at most (its length is noted)


def read_lines(stream: IO[bytes], limit: int = LINE_BYTES) -> Iterator[str]:
    """The lines of a child's output, each cut to `limit` bytes with the length it
    had: a child that prints a 64 MiB line costs a few KiB of memory and of log."""
    while True:
        chunk = stream.readline(limit + 1)
        if not chunk:
            return
        if chunk.endswith(b"\n"):
            yield chunk[:-1].decode(errors="replace")
            continue
        if len(chunk) <= limit:  # the last line, without a newline
            yield chunk.decode(errors="replace")
            continue
        total = len(chunk)
        while True:  # skip the rest of the line, counting it
            more = stream.readline(1 << 16)
            total += len(more)
            if not more or more.endswith(b"\n"):
                total -= more.endswith(b"\n")
                break
        yield f"{chunk[:limit].decode(errors='replace')}... [cut: the line had {total:,} bytes]"


class _NodeFormatter(logging.Formatter):
    """This process's records in the one format; a child's lines as they came (the
    child formatted them)."""

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "child_line", False):
            return record.getMessage()
        return super().format(record)


class NodeLog:
    """`node.log` in the run directory: this process's log records (once `attach`ed)
    and the lines of its children (`write_line`), in one file that rotates at
    `max_bytes`, `count` files kept (node.log, node.log.1, ...)."""

    def __init__(self, path: Path, max_bytes: int, count: int) -> None:
        if count < 2:
            raise ValueError("a rotating log keeps at least 2 files")
        self.path = path
        self.max_bytes = max_bytes
        self.count = count
        self.handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=count - 1, encoding="utf-8")
        self.handler.addFilter(_ComponentFilter(_component))
        self.handler.setFormatter(_NodeFormatter(FORMAT))
        self._attached = False

    def attach(self) -> NodeLog:
        """Write this process's own records too."""
        if not self._attached:
            logging.getLogger().addHandler(self.handler)
            self._attached = True
        return self

    def write_line(self, line: str) -> None:
        """One line a child wrote (already cut by `read_lines`); thread-safe."""
        record = logging.makeLogRecord({"msg": line, "levelno": logging.INFO,
                                        "levelname": "INFO", "child_line": True})
        self.handler.handle(record)

    def close(self) -> None:
        if self._attached:
            logging.getLogger().removeHandler(self.handler)
            self._attached = False
        self.handler.close()
