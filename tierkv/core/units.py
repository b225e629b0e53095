"""Sizes for people: one formatter shared by every message that names a size.

It lives in core so that core modules (the shared region's free-space check) and
the node's config checks say sizes the same way without core importing node.
"""

from __future__ import annotations


def format_bytes(n: int) -> str:
    """A size in the unit that shows it: a 200 MiB /dev/shm is not "0.0 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
