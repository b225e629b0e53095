"""The manager, policy and CPU-tier sections of `tierkv bench peers`.

Manager: requests per second through each manager, driven as its scheduler drives
it (`drivers.common.manager_requests`: 5000 requests x 64 keys, 16k blocks).
Policies: hit ratios on the same traces, the three drivers replaying at the same
time (a hit ratio does not depend on speed). CPU tier: LMCache's CPU backend
store/retrieve beside tierkv's CPU tier.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from tierkv.bench.common import human
from tierkv.bench.peers.procs import DriverError
from tierkv.bench.peers.rows import HIGHER
from tierkv.bench.peers.session import (
    KIB,
    OP_TIMEOUT_S,
    Session,
    comparison,
    result,
)

# -- manager --------------------------------------------------------------------------------


def run_manager(s: Session) -> None:
    from tierkv.node.config import CpuConfig

    default = CpuConfig().policy
    quick = s.opts.quick
    repeats = s.opts.pick(1, 3)
    work = {"n_requests": 500 if quick else 5000, "keys_per_request": 64, "seed": 11,
            "capacity": 2000 if quick else 16_000}
    ours = {f"inprocess:{p}": ("inprocess", p) for p in dict.fromkeys(("lru", "arc", default))}
    ours[f"broker:{default}"] = ("broker", default)
    theirs = {"vllm:lru": "lru", "vllm:arc": "arc"}
    seconds: dict[str, list[float]] = {k: [] for k in [*ours, *theirs]}
    errors: dict[str, str] = {}
    hits: dict[str, int] = {}
    s.part.note(f"manager: {work['n_requests']} requests x {work['keys_per_request']} keys, "
                f"{work['capacity']:,} blocks, {repeats} repeats")
    for rep in range(repeats):
        if rep and s.part.over_budget(f"manager repeats {rep + 1}-{repeats}"):
            break
        jobs: list[tuple[str, str, dict[str, Any]]] = [
            (k, "tierkv", {"mode": mode, "policy": p}) for k, (mode, p) in ours.items()]
        jobs += [(k, "vllm", {"policy": p}) for k, p in theirs.items()]
        jobs = jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]
        for key, system, args in jobs:
            drv = s.driver(system)
            if drv is None or key in errors:
                continue
            try:
                got = drv.call("manager_rps", OP_TIMEOUT_S, repeats=1, **work, **args)
            except DriverError as e:
                errors[key] = str(e)
                continue
            seconds[key] += got["seconds"]
            hits[key] = got["hits"]

    def rps(key: str) -> list[float] | None:
        return [work["n_requests"] / x for x in seconds[key]] or None

    vl = s.env.versions.get("vllm", "0.33.0")

    def peer(key: str, note: str = "") -> dict[str, Any]:
        skip = s.skip_reason("vllm")
        return result(f"vLLM {vl} CPUOffloadingManager ({key.split(':')[1]})", rps(key),
                      key=key, skipped=skip, error=None if skip else errors.get(key),
                      note=f"vLLM {hits[key]:,} key hits" if key in hits else note)

    def ours_result(key: str, label: str) -> dict[str, Any]:
        return result(label, rps(key), key="tierkv", error=errors.get(key),
                      note=f"tierkv {hits[key]:,} key hits" if key in hits else "")

    for p in ("lru", "arc"):
        s.comparisons.append(comparison(
            f"manager.inprocess.{p}", "manager", f"manager in process, {p}", "requests/s",
            HIGHER, ours_result(f"inprocess:{p}", f"tierkv TieringManager ({p})"),
            [peer(f"vllm:{p}")]))
    if default not in ("lru", "arc"):
        s.comparisons.append(comparison(
            f"manager.inprocess.{default}", "manager",
            f"manager in process, tierkv default ({default})", "requests/s", HIGHER,
            ours_result(f"inprocess:{default}", f"tierkv TieringManager ({default})"),
            [peer("vllm:lru"), peer("vllm:arc")]))
    s.comparisons.append(comparison(
        f"manager.broker.{default}", "manager", f"manager through the broker ({default})",
        "requests/s", HIGHER,
        ours_result(f"broker:{default}", f"tierkv broker + Client.batch ({default})"),
        [peer("vllm:lru"), peer("vllm:arc")]))


# -- policies -------------------------------------------------------------------------------


def _trace_files(s: Session) -> list[tuple[str, Path, tuple[int, ...]]]:
    """(name, Mooncake-format file, capacities): the conversation trace when
    present, then the synthetic presets written out as traces."""
    from tierkv.bench.policy_speed import DEFAULT_TRACE
    from tierkv.workloads.synthetic import PRESETS, generate_workload

    quick = s.opts.quick
    out: list[tuple[str, Path, tuple[int, ...]]] = []
    trace = s.opts.trace or DEFAULT_TRACE
    if trace.exists():
        out.append(("conversation", trace, (100, 400) if quick else (1000, 4000, 16000)))
    else:
        s.part.note(f"trace {trace} not found: the conversation trace is not replayed "
                    "(--trace PATH)")
    for name in PRESETS:
        path = s.work / f"workload-{name}.jsonl"
        with open(path, "w") as f:
            for r in generate_workload(name, 300 if quick else 6000, seed=0):
                f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                    "output_length": r.output_length,
                                    "hash_ids": list(r.hash_ids)}) + "\n")
        out.append((name, path, (400,) if quick else (4000,)))
    return out


def run_policies(s: Session) -> None:
    from tierkv.core.policies import known_policies
    from tierkv.node.config import CpuConfig

    default = CpuConfig().policy
    ours = sorted(known_policies(), key=lambda p: p != default)
    theirs = {"vllm": ("lru", "arc"), "lmcache": ("lru", "lfu", "fifo", "mru")}
    traces = _trace_files(s)
    plan: dict[str, list[tuple[str, str, int]]] = {"tierkv": [], "vllm": [], "lmcache": []}
    for _name, path, capacities in traces:
        for capacity in capacities:
            plan["tierkv"] += [(p, str(path), capacity) for p in ours]
            for system, policies in theirs.items():
                plan[system] += [(p, str(path), capacity) for p in policies]
    ratios: dict[tuple[str, str, str, int], float] = {}
    errors: dict[str, str] = {}

    def replay(system: str) -> None:
        drv = s.driver(system)
        if drv is None:
            return
        for policy, path, capacity in plan[system]:
            try:
                got = drv.call("hit_ratio", OP_TIMEOUT_S, trace=path, capacity=capacity,
                               policy=policy)
            except DriverError as e:
                errors[system] = str(e)
                return
            ratios[(system, policy, path, capacity)] = got["hit_ratio"]

    for system in plan:  # start them here: a driver's start is not thread-safe
        s.driver(system)
    t0 = time.monotonic()
    threads = [threading.Thread(target=replay, args=(system,)) for system in plan]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    s.part.note(f"policies: {len(traces)} traces replayed by the three drivers at once in "
                f"{time.monotonic() - t0:.0f} s")
    labels = {"vllm": f"vLLM {s.env.versions.get('vllm', '0.33.0')}",
              "lmcache": f"LMCache {s.env.versions.get('lmcache', '0.5.6')}"}
    for name, path, capacities in traces:
        for capacity in capacities:
            peers = []
            for system, policies in theirs.items():
                skip = s.skip_reason(system)
                for p in policies:
                    got = ratios.get((system, p, str(path), capacity))
                    peers.append(result(
                        f"{labels[system]} {p}", None if got is None else [got],
                        key=f"{system}:{p}", skipped=skip,
                        error=None if skip or got is not None else errors.get(system,
                                                                               "missing")))
            for p in ours:
                got = ratios.get(("tierkv", p, str(path), capacity))
                mark = " (default)" if p == default else ""
                s.comparisons.append(comparison(
                    f"policy.{name}.{capacity}.{'default.' if p == default else ''}{p}",
                    "policies",
                    f"hit ratio, {name} @ {capacity:,} blocks, tierkv {p}{mark}", "", HIGHER,
                    result(f"tierkv {p}{mark}", None if got is None else [got], key="tierkv",
                           error=None if got is not None else errors.get("tierkv", "missing")),
                    peers, paired=False,
                    headline=p == default and name == "conversation" and capacity == 4000,
                    column=f"{name}@{capacity}"))


# -- CPU tier -------------------------------------------------------------------------------


def run_cpu(s: Session) -> None:
    count = 64 if s.opts.quick else 1000
    repeats = s.opts.pick(2, 3)
    size = 256 * KIB
    got: dict[str, dict[str, Any]] = {}
    for system in ("tierkv", "lmcache"):
        drv = s.driver(system)
        if drv is None:
            continue
        try:
            got[system] = drv.call("cpu_tier", OP_TIMEOUT_S, block_bytes=size, count=count,
                                   repeats=repeats, seed=5)
        except DriverError as e:
            got[system] = {"error": str(e)}
    nbytes = size * count
    lm = s.env.versions.get("lmcache", "0.5.6")
    for what, attr, our_label, their_label in (
            ("store", "store_s", "tierkv CPU tier via broker + CPU worker",
             f"LMCache {lm} CPU backend (allocate, copy in, batched_put)"),
            ("retrieve", "load_s", "tierkv CPU tier via broker + CPU worker",
             f"LMCache {lm} CPU backend (batched_get, copy out)")):

        def side(system: str, label: str, attr: str = attr) -> dict[str, Any]:
            skip = s.skip_reason(system)
            run = got.get(system, {})
            samples = [nbytes / x / 1e9 for x in run.get(attr, [])] or None
            return result(label, samples, key=system if system == "tierkv" else "lmcache:cpu",
                          skipped=skip, error=None if skip or samples else run.get(
                              "error", "not measured"))

        s.comparisons.append(comparison(
            f"cpu.{what}", "cpu", f"CPU tier {what} {human(size)} x {count}", "GB/s", HIGHER,
            side("tierkv", our_label), [side("lmcache", their_label)], paired=False))


