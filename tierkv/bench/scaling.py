"""`tierkv bench scaling`: the broker's cost per operation as resident blocks grow.

A control plane whose per-operation cost grows with the number of blocks it holds
fails exactly when a node gets big, so the cost is measured at 1e3, 1e4, 1e5 and
1e6 resident blocks and reported as the ratio to the cost at 1e3 (flat = 1.0):

- in process: the broker's manager (`TieringManager` over `PrimaryTier`, LRU),
  the pure cost of the data structures;
- the real broker process, over its client socket, with a CPU tier of 4 KiB
  pages (1e6 blocks = 4 GiB of shared memory), at every size that fits in this
  machine's /dev/shm and memory; a size that does not fit is named in the output.

At every size the CPU tier is full (num_blocks = N), so each store evicts. The
operations: `lookup` of 64 resident keys drawn at random (every one a hit, so
each lookup walks all 64), `store` of 64 new keys (evicting 64; for the broker,
the round trip of the request that allocates, evicts and queues the copy, not
the copy), and an idle `step`. Random keys defeat the CPU caches at 1e6 as an
engine's keys would: some growth from cache misses is memory, not algorithm. To
tell the two apart, in process also looks up the same 64 keys over and over
(`lookup, hot keys`): cached, that cost is the data structures' alone.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from tierkv.bench.common import FLAT, Options, Part, Row, Stat, ratio

KEYS_PER_OP = 64
PAGE = 4096  # the smallest page: the most blocks per byte of shared memory
FILL_CHUNK = 50_000  # keys per store while filling (a request takes 65536 at most)
KV_BLOCKS = 1024  # the engine's KV cache; fill stores cycle over its blocks
OPS = ("lookup", "store", "step")
HOT = "lookup, hot keys"


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


class Resident:
    """Which keys the tier holds: [lo, hi). With LRU and no touches (a lookup does
    not touch) blocks are evicted in the order they were stored, so the range is
    exact; the benchmark checks it by counting hits."""

    def __init__(self, n: int) -> None:
        self.lo, self.hi = 0, n

    def sample(self, rng: random.Random) -> list[bytes]:
        return [key(i) for i in rng.sample(range(self.lo, self.hi), KEYS_PER_OP)]

    def fresh(self) -> list[bytes]:
        """The next 64 new keys; storing them evicts the 64 oldest."""
        keys = [key(i) for i in range(self.hi, self.hi + KEYS_PER_OP)]
        self.lo += KEYS_PER_OP
        self.hi += KEYS_PER_OP
        return keys


def per_op(fn: Callable[[Any], Any], args: list[Any]) -> tuple[float, list[Any]]:
    """Seconds per call of `fn` over `args` (prepared before timing), and results."""
    out = []
    t0 = time.perf_counter()
    for a in args:
        out.append(fn(a))
    return (time.perf_counter() - t0) / len(args), out


def _check_hits(results: list[Any], where: str) -> None:
    short = [r for r in results if (r if isinstance(r, int) else r.hits) != KEYS_PER_OP]
    if short:
        raise RuntimeError(f"{where}: {len(short)} lookups of resident keys were not all hits")


# -- in process -----------------------------------------------------------------------


def inprocess_costs(n: int, calls: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per op at `n` resident blocks, one figure per repeat."""
    from tierkv.core.primary import PrimaryTier
    from tierkv.core.tiering import TieringManager

    manager = TieringManager(PrimaryTier(n, enable_events=False))
    for start in range(0, n, FILL_CHUNK):
        out = manager.prepare_store([key(i) for i in range(start, min(n, start + FILL_CHUNK))])
        assert out is not None
        manager.complete_store(out.keys_to_store)
    resident, rng = Resident(n), random.Random(n)
    costs: dict[str, list[float]] = {op: [] for op in (OPS[0], HOT, *OPS[1:])}

    def store(keys: list[bytes]) -> None:
        out = manager.prepare_store(keys)
        if out is None or len(out.evicted_keys) != KEYS_PER_OP:
            raise RuntimeError(f"in process at {n}: a store did not evict {KEYS_PER_OP}")
        manager.complete_store(out.keys_to_store)

    for _ in range(repeats):
        took, hits = per_op(lambda k: manager.lookup(k).hits,
                            [resident.sample(rng) for _ in range(calls)])
        _check_hits(hits, f"in process at {n}")
        costs["lookup"].append(took)
        costs[HOT].append(per_op(lambda k: manager.lookup(k).hits,
                                 [resident.sample(rng)] * calls)[0])
        costs["store"].append(per_op(store, [resident.fresh() for _ in range(calls)])[0])
        costs["step"].append(per_op(lambda _: manager.step(), [None] * calls)[0])
    return costs


# -- the broker -----------------------------------------------------------------------


def fits(n: int) -> bool:
    """Room for n pages in /dev/shm and in memory, with a margin for everything else."""
    need = n * PAGE * 1.25 + (1 << 30)
    shm = os.statvfs("/dev/shm")
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable"))
    return need < min(shm.f_bavail * shm.f_frsize, avail)


def _fill(part: Part, client: Any, n: int) -> bool:
    """Store keys 0..n-1; False if the budget ran out first."""
    for start in range(0, n, FILL_CHUNK):
        if part.budget.spent():
            return False
        ids = range(start, min(n, start + FILL_CHUNK))
        store = client.store([key(i) for i in ids], [i % KV_BLOCKS for i in ids])
        if len(store.keys_accepted) != len(ids):
            raise RuntimeError(f"filling {n}: the broker took {len(store.keys_accepted)} of "
                               f"{len(ids)} keys")
        client.wait([store.job_id], timeout=300)
    client.step()  # hands over the events `wait` held back, so no timed step gets them
    return True


def broker_costs(part: Part, n: int, calls: int, repeats: int) -> dict[str, list[float]] | None:
    """Seconds per round trip at `n` resident blocks, one figure per repeat; None
    if the budget ran out while filling."""
    from tierkv.bench.broker_ops import bench_node

    with bench_node(n, PAGE, kv_blocks=KV_BLOCKS) as (client, _kv):
        t0 = time.monotonic()
        if not _fill(part, client, n):
            return None
        part.note(f"broker filled with {n:,} blocks in {time.monotonic() - t0:.1f} s")
        resident, rng = Resident(n), random.Random(n)
        costs: dict[str, list[float]] = {op: [] for op in OPS}
        store_calls = max(1, calls // 5)  # each waits for its copy, untimed
        # A first round warms the new processes' caches and sockets; it is dropped.
        for _ in range(repeats + 1):
            took, results = per_op(client.lookup, [resident.sample(rng) for _ in range(calls)])
            _check_hits(results, f"broker at {n}")
            costs["lookup"].append(took)
            seconds = 0.0
            for _ in range(store_calls):
                keys = resident.fresh()
                t0 = time.perf_counter()
                store = client.store(keys, list(range(KEYS_PER_OP)))
                seconds += time.perf_counter() - t0
                if len(store.keys_accepted) != KEYS_PER_OP:
                    raise RuntimeError(f"broker at {n}: a store was refused")
                client.wait([store.job_id])
            costs["store"].append(seconds / store_calls)
            costs["step"].append(per_op(lambda _: client.step(), [None] * calls)[0])
        return {op: v[1:] for op, v in costs.items()}


# -- the part ---------------------------------------------------------------------------


def _rows(part: Part, mode: str, costs: dict[int, dict[str, list[float]]]) -> None:
    """Rows of one mode: per op and size, cost and ratio to the smallest size; the
    largest size measured is the headline."""
    if not costs:
        return
    sizes = sorted(costs)
    base = sizes[0]
    for op in costs[base]:
        for n in sizes[1:]:
            part.add(Row(
                "scaling", f"{mode} {op}, {n:.0e} resident", Stat.of(costs[n][op]).scaled(1e6),
                "us/op", f"at {base:.0e}", ratio(costs[n][op], costs[base][op], paired=False),
                Stat.of(costs[base][op]).scaled(1e6), want=FLAT, headline=n == sizes[-1],
                paired=False))


def _summary_line(costs: dict[str, list[float]]) -> str:
    return ", ".join(f"{op} {statistics.median(v) * 1e6:.1f} us" for op, v in costs.items())


def run(part: Part, opts: Options) -> None:
    repeats = opts.pick(2, 5)
    sizes = [1_000, 10_000] if opts.quick else [1_000, 10_000, 100_000, 1_000_000]
    calls = 50 if opts.quick else 500
    part.note(f"{KEYS_PER_OP} keys per op, {calls} ops per repeat ({calls // 5} stores for "
              f"the broker), {repeats} repeats; LRU; CPU tier full at every size")
    local: dict[int, dict[str, list[float]]] = {}
    for n in sizes:
        if part.over_budget(f"in process at {n:,}"):
            break
        local[n] = inprocess_costs(n, calls, repeats)
        gc.collect()  # the manager of 1e6 blocks goes before the next one is built
        part.note(f"in process at {n:,}: {_summary_line(local[n])}")
    _rows(part, "in-process", local)

    remote: dict[int, dict[str, list[float]]] = {}
    for n in sizes:
        if not fits(n):
            part.note(f"broker at {n:,}: {n * PAGE / 2**30:.1f} GiB of pages do not fit in "
                      "/dev/shm and memory here; not measured")
            continue
        if part.over_budget(f"broker at {n:,}"):
            break
        costs = broker_costs(part, n, calls, repeats)
        if costs is None:
            part.skip(f"broker at {n:,} (budget spent while filling)")
            break
        remote[n] = costs
        part.note(f"broker at {n:,}: {_summary_line(costs)}")
    _rows(part, "broker", remote)
