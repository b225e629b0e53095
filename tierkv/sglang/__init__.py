"""tierkv as SGLang's HiCache storage layer (L3): `TierkvStorage`, loaded by SGLang's
dynamic backend factory (`--hicache-storage-backend dynamic`, see
`tierkv.sglang.storage` and the README's SGLang section).

Imported lazily: `tierkv.sglang.pages` and `.identity` need no SGLang, and a missing
SGLang fails with an install hint only when the backend class is asked for.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierkvStorage"]

INSTALL_HINT = ("tierkv.sglang needs SGLang 0.5.23 (pip install 'sglang==0.5.23'; on a "
                "machine without a GPU, scripts/sglang-cpu.txt lists the lean install)")


def __getattr__(name: str) -> Any:
    if name != "TierkvStorage":
        raise AttributeError(f"module 'tierkv.sglang' has no attribute {name!r}")
    try:
        from tierkv.sglang.storage import TierkvStorage
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "sglang":
            raise ImportError(INSTALL_HINT) from e
        raise
    return TierkvStorage
