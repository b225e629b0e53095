"""The disk tier (`type = "disk"`): `backend.DiskBackend` over slab files of verified
slots (`slabs`), made durable once per job (`commit`), laid out by `layout`;
`options` declares its config keys.

The backend is imported on first use: checking a config's disk entry reads
`options` only."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"DiskBackend": "workers.disk.backend", "HEADER_AREA": "workers.disk.layout",
         "namespace_dir": "workers.disk.layout", "namespace_tag": "workers.disk.layout",
         "slot_bytes_for": "workers.disk.layout"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
