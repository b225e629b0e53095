"""The small set of error codes every edge translates into (fsspec-style).

Backends raise `TierError` with one of these codes; the tier process reports the
code to the broker; the client sees `RemoteError.code`. The original exception is
kept as `__cause__` and never sent anywhere (it may name a secret).
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    NOT_FOUND = "not_found"  # the key or object is not there
    NO_SPACE = "no_space"  # the tier or the disk is full
    RETRYABLE = "retryable"  # a transient fault (throttling, a dropped connection)
    CORRUPT = "corrupt"  # bytes failed verification; the bad copy was removed
    FATAL = "fatal"  # a bug or a misconfiguration; retrying will not help
    TIMEOUT = "timeout"  # a deadline passed
    UNAVAILABLE = "unavailable"  # the peer or endpoint is gone
    BAD_REQUEST = "bad_request"  # the caller sent something invalid
    PROTOCOL = "protocol"  # a malformed message
    NOT_OWNER = "not_owner"  # the state named belongs to another client (or to none)
    EXPIRED = "expired"  # the reservation or pin passed its deadline and was ended
    QUOTA = "quota"  # the client holds its share of the CPU tier already
    # A store or reserve of more new blocks than the whole CPU tier has: it can never
    # fit, unlike a tier that is only full now (`refused`); split it.
    TOO_LARGE = "too_large"
    # Rows written into a CPU region this broker does not serve (a broker restarted
    # since the engine mapped it): the bytes are not in the tier, so nothing is committed.
    STALE_REGION = "stale_region"


# Failures that mean a tier does not hold the key (any more), as opposed to a dead
# process or a timeout, which say nothing about the key.
LOST = frozenset({ErrorCode.NOT_FOUND, ErrorCode.CORRUPT})


class TierError(Exception):
    """A tier operation failed; `code` says how the caller should treat it."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.message}"
