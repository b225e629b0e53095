"""The options of a disk tier entry (`DiskBackend` takes exactly these), as data: the
config loader checks an entry with this module alone, before any process starts."""

from __future__ import annotations

import os
from pathlib import Path

from tierkv.tiers.options import REQUIRED, Option, TierOptions, at_least, non_empty, positive

DEFAULT_SLAB_BYTES = 1 << 30
# Bytes of a job one I/O thread reads or writes in one request (adjacent slots in
# one preadv/pwritev); see `DiskBackend.batch_keys` for why this size.
DEFAULT_RUN_BYTES = 8 << 20


def _root_here(root: str) -> str | None:
    """The root must exist on the machine that starts the node (it is not created:
    a typo must not put a cache on the wrong disk)."""
    path = Path(root)
    if not path.is_dir():
        return f"{root!r} is not a directory on this machine" if path.exists() else (
            f"{root!r} does not exist: create it, or fix the path")
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{root!r} is not writable by this user"
    return None


OPTIONS = TierOptions(
    "disk",
    "blocks in preallocated slab files of verified, crash-safe slots under one directory",
    (
        Option("root", str, REQUIRED, "an existing directory; blocks go to "
               "<root>/ns-<namespace>-<hash>/ (one tier process per root)",
               check=non_empty, local=_root_here),
        Option("budget_bytes", int, REQUIRED, "bytes of slots (a slot is one block plus a "
               "4 KiB header, rounded up to 4 KiB)", check=at_least(1)),
        Option("slab_bytes", int, DEFAULT_SLAB_BYTES, "bytes of one slab file",
               check=positive),
        Option("durable", bool, True, "a store is reported only once it is on disk "
               "(false: no fdatasync, for benchmarks)"),
        Option("o_direct", (str, bool), "auto", "bypass the page cache: \"auto\" where the "
               "filesystem allows, true insists, false never", choices=("auto", True, False)),
        Option("group_commit", bool, True, "concurrent stores share one fdatasync"),
        Option("sync_per", str, "job", "one flush per store job, or one per block",
               choices=("job", "store")),
        Option("run_bytes", int, DEFAULT_RUN_BYTES, "bytes of a job one I/O thread moves in "
               "one request (adjacent slots at once); 0: a block at a time",
               check=at_least(0)),
        Option("staging", bool, True, "O_DIRECT runs go through a huge-page buffer per "
               "I/O thread (fewer DMA segments per request; costs a copy)"),
    ),
)
