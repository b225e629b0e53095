"""Where and how the disk tier lays blocks out: slot geometry, the namespace's
directory and header tag, and the translation of OS errors at the edge."""

from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path

import numpy as np

from tierkv.core.blockformat import HEADER_SIZE
from tierkv.core.errors import ErrorCode, TierError

PAGE = 4096  # O_DIRECT alignment of offsets, lengths and buffers (covers 512-byte sectors)
HEADER_AREA = PAGE
LAYOUT_VERSION = 1
SCAN_PROGRESS_SLOTS = 100_000  # a progress line every this many slots while scanning
O_DIRECT_FLAG = getattr(os, "O_DIRECT", 0)
ZERO_HEADER = bytes(HEADER_SIZE)
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def align_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


def slot_bytes_for(block_bytes: int) -> int:
    """Bytes one block occupies on disk: header area plus the payload, both aligned."""
    return HEADER_AREA + align_up(block_bytes)


def namespace_dir(namespace: str) -> str:
    """The directory of a namespace: a readable slug for people, a hash of the full
    name for uniqueness. Nothing of the namespace can form a path component."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", namespace)[:40] or "_"
    return f"ns-{slug}-{hashlib.sha256(namespace.encode()).hexdigest()[:16]}"


def namespace_tag(namespace: str) -> bytes:
    """The namespace as written into block headers (at most 128 bytes)."""
    raw = namespace.encode()
    return raw if len(raw) <= 128 else b"sha256:" + hashlib.sha256(raw).hexdigest().encode()


def buffer_address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def io_error(e: OSError, what: str) -> TierError:
    """Translate at the edge: a full disk is NO_SPACE, anything else FATAL."""
    code = ErrorCode.NO_SPACE if e.errno in NO_SPACE_ERRNOS else ErrorCode.FATAL
    err = TierError(code, f"{what}: {e.strerror or e}")
    err.__cause__ = e
    return err



ZERO_PAGE_TAIL = bytes(HEADER_AREA - HEADER_SIZE)


def check_root(root: Path) -> Path:
    """A clear error at start for a root that is missing or not a directory."""
    if not root.exists():
        raise TierError(ErrorCode.FATAL, f"disk tier root {root} does not exist: "
                                         f"create it or fix 'root' in the tier entry")
    if not root.is_dir():
        raise TierError(ErrorCode.FATAL, f"disk tier root {root} is not a directory")
    return root

