"""The broker's own cost of one `ops` message, in process (no sockets, no client):
a 64-key lookup and a step of 256 requests x 64 keys of hits, the minimum and median
of many runs. Run it on two checkouts to compare two versions of the broker's logic:
`PYTHONPATH=<checkout> python -m tierkv.bench.broker_cost` (the round-trip rows of
`tierkv bench control` add the transport, which swings by 2x on a loaded 2-core
machine and hides a change of a few microseconds)."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

from tierkv.wire.keyblob import pack_counts, pack_keys
from tierkv.wire.protocol import KeyGroups, OpsRequest

REQUESTS, KEYS = 256, 64


def _groups(chains: list[list[bytes]], req_ids: list[str]) -> dict:
    blob, width, lens = pack_keys([k for c in chains for k in c])
    return {"keys": blob, "key_len": width, "key_lens": lens,
            "groups": KeyGroups(pack_counts([len(c) for c in chains]), req_ids)}


def main() -> int:
    from broker.core import BrokerCore
    from tierkv.core.primary import PrimaryTier
    from tierkv.core.tiering import TieringManager
    from tierkv.node.config import config_from_dict

    blocks = REQUESTS * KEYS
    with tempfile.TemporaryDirectory() as run_dir:
        config = config_from_dict({"instance": "brokercost", "run_dir": run_dir,
                                   "cpu": {"num_blocks": blocks, "page_size": 1024}})
        manager = TieringManager(PrimaryTier(blocks, "lru"), lease_s=1e6)
        core = BrokerCore(config, manager, {}, lambda *a: True)
        ids = iter(range(1, 1 << 62))
        keys = [i.to_bytes(8, "big") for i in range(blocks)]
        chains = [keys[i * KEYS:(i + 1) * KEYS] for i in range(REQUESTS)]
        engine = b"engine"
        fill = _groups(chains, [])
        g = fill.pop("groups")
        core.on_client(engine, OpsRequest(next(ids), **fill, reserve=g))
        core.on_client(engine, OpsRequest(next(ids), **fill, commit=g,
                                          commit_ok=b"\x01" * REQUESTS))
        step = _groups(chains, [f"r{i}" for i in range(REQUESTS)])
        one = _groups([keys[:KEYS]], ["one"])

        def timed(make: Callable[[], OpsRequest], n: int) -> list[float]:
            out = []
            for _ in range(n):
                msg = make()
                t0 = time.perf_counter()
                core.on_client(engine, msg)
                out.append(time.perf_counter() - t0)
            return out

        rows = (
            (f"lookup {KEYS} keys", lambda: OpsRequest(
                next(ids), one["keys"], one["key_len"], one["key_lens"], lookup=one["groups"]),
             3000),
            (f"step {REQUESTS} req x {KEYS} keys, all hits", lambda: OpsRequest(
                next(ids), step["keys"], step["key_len"], step["key_lens"],
                lookup=step["groups"], step=True), 60),
        )
        for name, make, n in rows:
            timed(make, n // 10)  # warm up
            t = timed(make, n)
            print(f"{name}: min {min(t) * 1e6:.1f} us, median "
                  f"{statistics.median(t) * 1e6:.1f} us ({n} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
