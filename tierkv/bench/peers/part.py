"""`tierkv bench peers`: the run. Builds (or reuses) the peers' environment, starts
one driver process per system, makes every system do the same work in the same
run, and turns the record into rows (`rows.build_rows`).

Sections, in order (each checks the part's budget before it starts):

1. disk: store (durable / without syncs) and cold load of 1000 blocks at 256 KiB
   and 2 MiB in the same directory, every system in turn in every repeat (the
   order rotates); restart recovery in a fresh process over the stored directory.
2. integrity: a flipped, a truncated and a swapped block, read back.
3. manager: requests per second through each manager, driven as its scheduler
   drives it (`drivers.common.manager_requests`: 5000 requests x 64 keys, 16k
   blocks).
4. policies: hit ratios on the same traces (the Mooncake conversation trace and
   `tierkv.workloads.synthetic`'s presets), the three drivers replaying at the same time
   (a hit ratio does not depend on speed).
5. cpu: LMCache's CPU backend store/retrieve beside tierkv's CPU tier.
6. bound: disk use after storing 3x the configured bound.

Cold reads are made cold the same way for every system, by the parent between a
store and its load: `tierkv.bench.disk_io.drop_caches` (sync, then
`/proc/sys/vm/drop_caches`, or `posix_fadvise(DONTNEED)` on every file).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from tierkv.bench.common import Options, Part, work_dir
from tierkv.bench.peers import env as peer_env
from tierkv.bench.peers.disk import run_bound, run_disk, run_integrity
from tierkv.bench.peers.rows import comparison_rows, policy_table
from tierkv.bench.peers.service import run_cpu, run_manager, run_policies
from tierkv.bench.peers.session import Session

# -- the part -------------------------------------------------------------------------------

SECTIONS: list[tuple[str, Callable[[Session], None]]] = [
    ("disk", run_disk), ("integrity", run_integrity), ("manager", run_manager),
    ("policies", run_policies), ("cpu", run_cpu), ("bound", run_bound),
]


def run_part(part: Part, opts: Options) -> None:
    t0 = time.monotonic()
    try:
        env = peer_env.ensure(echo=part.out)
    except peer_env.EnvError as e:
        part.note(f"the peers' environment could not be built: {e}")
        env = peer_env.PeerEnv(peer_env.cache_root(), Path("/nonexistent"),
                               skipped={p: str(e) for p in peer_env.PINS})
    part.note(f"peers' environment {env.python.parent.parent}: "
              + (f"built and checked in {env.built_s:.0f} s" if env.built_s else
                 f"reused ({time.monotonic() - t0:.0f} s)"))
    for peer in peer_env.PINS:
        part.note(f"{peer}: " + (env.versions.get(peer) or f"skipped: {env.skipped[peer]}"))
    logs = env.root / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    with work_dir(opts.disk_dir, "tierkv-peers-") as work:
        session = Session(part, opts, env, work, logs)
        try:
            for name, section in SECTIONS:
                if part.over_budget(name):
                    continue
                done = len(session.comparisons)
                started = time.monotonic()
                section(session)
                part.note(f"{name}: {time.monotonic() - started:.0f} s")
                for item in session.comparisons[done:]:  # rows as they are measured
                    for row in comparison_rows(item):
                        part.add(row)
        finally:
            session.close()
    record = {"versions": {**env.versions, "tierkv": _tierkv_version()},
              "skipped": env.skipped, "load_avg_end": [round(x, 2) for x in os.getloadavg()],
              "comparisons": session.comparisons}
    path = env.root / "last-run.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    part.note(f"record of this run: {path}; driver logs: {logs}")
    table = policy_table(record)
    if table:
        part.note("hit ratios (trace@capacity):\n" + table)


def _tierkv_version() -> str:
    import tierkv

    return getattr(tierkv, "__version__", "?")


