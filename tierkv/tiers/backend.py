"""The storage primitives a tier implements: the whole plugin interface.

A backend stores and loads single blocks between a `memoryview` of a CPU-tier row
and its medium. Everything else (sockets, batching, threads, existence caching,
events, liveness) is done for it by the generic tier process or `LocalTier`.
Third-party tiers subclass `TierBackend` and register it in the `tierkv.tiers`
entry-point group.

Threading: methods are called from a pool of worker threads and may block; an
implementation must be thread-safe. Errors are raised as `TierError` with a code
(`tierkv.core.errors.ErrorCode`); anything else is reported as a fatal error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

from tierkv.core.errors import TierError
from tierkv.core.keys import OffloadKey
from tierkv.tiers.options import TierOptions

E = TypeVar("E", bound=BaseException)


def detached(error: E) -> E:
    """`error` without its traceback (nor its cause's), to be kept in a list of
    answers: a kept traceback holds the frame that raised it, and with it the
    callers' row views, past the region's close (a reference cycle)."""
    error.__traceback__ = None
    if error.__cause__ is not None:
        error.__cause__.__traceback__ = None
    return error


class TierBackend(ABC):
    # The name a config uses (`type = "disk"`), set by each implementation.
    type_name: ClassVar[str] = "?"
    # True if the medium is shared between nodes, so it can hold keys this node
    # never stored: the broker then asks `exists` for keys it does not know.
    shared: ClassVar[bool] = False
    # The options a config entry may give, as data (`tierkv.tiers.options`): checked
    # with the rest of the config before any process starts, and printed by
    # `tierkv config --explain`. None: taken from the constructor's signature.
    options: ClassVar[TierOptions | None] = None

    @abstractmethod
    def store(self, key: OffloadKey, src: memoryview, pinned: Container[OffloadKey] = ()) -> None:
        """Persist `src` under `key`. May evict other keys to make room, never one in
        `pinned` (the keys of the job being stored); report them via `take_evicted`."""

    @abstractmethod
    def load(self, key: OffloadKey, dst: memoryview) -> None:
        """Fill `dst` with the verified bytes of `key`. NOT_FOUND if absent; CORRUPT
        (after removing the bad copy) if verification fails."""

    @abstractmethod
    def exists(self, key: OffloadKey) -> bool:
        """Whether the medium holds `key` (may ask a remote service)."""

    @abstractmethod
    def delete(self, key: OffloadKey) -> None:
        """Remove `key`; absent keys are not an error."""

    @abstractmethod
    def inventory(self) -> list[OffloadKey]:
        """Keys held at start-up (what survived a restart), reported in the hello."""

    def batch_keys(self, block_bytes: int) -> int:
        """How many keys of `block_bytes` one I/O task hands to `store_many` /
        `load_many`. 1 (the default): a task per key, so a medium served by many
        concurrent small requests (S3) keeps them concurrent. A medium that serves
        large contiguous transfers better (a local disk) returns more."""
        return 1

    def store_many(self, keys: Sequence[OffloadKey], srcs: Sequence[memoryview],
                   pinned: Container[OffloadKey] = ()) -> list[TierError | None]:
        """`store` of each key in turn; the error of each key, None where it was
        stored. Overridden by a backend that moves several blocks per request."""
        errors: list[TierError | None] = []
        for key, src in zip(keys, srcs, strict=True):
            try:
                self.store(key, src, pinned)
                errors.append(None)
            except TierError as e:
                errors.append(detached(e))
        return errors

    def load_many(self, keys: Sequence[OffloadKey],
                  dsts: Sequence[memoryview]) -> list[TierError | None]:
        """`load` of each key in turn; the error of each key, None where it loaded."""
        errors: list[TierError | None] = []
        for key, dst in zip(keys, dsts, strict=True):
            try:
                self.load(key, dst)
                errors.append(None)
            except TierError as e:
                errors.append(detached(e))
        return errors

    def capacity(self) -> int | None:
        """Budget in bytes, or None when unbounded."""
        return None

    def touch(self, keys: Iterable[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """The keys were used (promoted): refresh them in the tier's eviction order."""

    def sync(self) -> None:  # noqa: B027 - optional hook
        """Make every `store` that has returned durable. Called once per store job,
        before the job is reported stored, so a batch costs one flush, not one per
        key. Backends whose `store` is durable on return need not implement it."""

    def take_evicted(self) -> list[OffloadKey]:
        """Keys dropped by the backend's own eviction since the last call."""
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files, connections and pools. Idempotent."""
