"""`tierkv bench peers`: tierkv beside LMCache and vLLM on the same work, in one run.

Opt-in (not part of `all`). The part lives in `tierkv.bench.peers.part`; this
package's modules that run inside the peers' environment (`drivers`) import
nothing of tierkv beyond `drivers.common`, so importing this package stays cheap.
"""

from __future__ import annotations

from typing import Any


def run(part: Any, opts: Any) -> None:
    from tierkv.bench.peers.part import run_part

    run_part(part, opts)
