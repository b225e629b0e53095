"""Keys and the small value types shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OffloadKey = bytes
MAX_KEY_LEN = 64


def check_keys(keys: object, what: str = "keys") -> list[OffloadKey]:
    """Validate a key list at an API edge: bytes, 1..64 long. Returns it as a list."""
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"{what} must be a list of bytes, got {type(keys).__name__}")
    # The common case checks in C-level loops; the slow path names the culprit.
    if keys and (set(map(type, keys)) != {bytes} or not 0 < min(map(len, keys))
                 or max(map(len, keys)) > MAX_KEY_LEN):
        for i, key in enumerate(keys):
            if not isinstance(key, bytes):
                raise TypeError(f"{what}[{i}] must be bytes, got {type(key).__name__}")
            if not 0 < len(key) <= MAX_KEY_LEN:
                raise ValueError(f"{what}[{i}] must be 1..{MAX_KEY_LEN} bytes, got {len(key)}")
    return list(keys)


@dataclass(frozen=True, slots=True)
class OffloadEvent:
    """Keys that became readable in (`stored`) or left (`removed`) a tier."""

    kind: Literal["stored", "removed"]
    keys: tuple[OffloadKey, ...]
    tier: str
