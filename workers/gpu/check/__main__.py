"""``python -m workers.gpu.check``: the parts of ``scripts/gpu-check`` after the
install, in one process, within a time budget (the script's watchdog is 215 s).

Parts: the environment; a CPU round trip (always); on CUDA the per backend facts,
the pin/unpin time of 16 GiB, copies ordered after a model still writing (and the
same race without the ordering, as a control), ``pytest tests/gpu`` (the
correctness of the device path: both layouts, two worker processes on one device,
odd sizes, forced registration failures followed by a kernel launch, the IPC
counters), bandwidth against a pinned cudaMemcpyAsync, the same beside a matmul
process, and the worker's own GPU memory. Exit 0 only if every correctness part
passed (1 if one failed; 2 if only a measurement or the control failed). It sets
no environment variable of its own (tests/gpu set theirs through pytest's
monkeypatch, restored after each test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

BUDGET_S = 200.0
START = time.monotonic()
RESULTS: list[tuple[str, bool, bool]] = []  # (part, ok, correctness?)


def say(*args: object) -> None:
    print(f"[gpu-check {time.monotonic() - START:6.1f}s]", *args, flush=True)


def part(name: str, fn: Callable[[], None], correctness: bool = True) -> bool:
    say(f"== {name}")
    try:
        fn()
        ok = True
        say(f"PASS {name}")
    except Exception:
        ok = False
        say(f"FAIL {name}")
        traceback.print_exc()
        sys.stdout.flush()
    RESULTS.append((name, ok, correctness))
    return ok


def cpu_round_trip() -> None:
    """Store, zero, load, compare on the CPU backend (the same engine, no device)."""
    import numpy as np
    import torch

    from tierkv.core.shm import SharedRegion
    from tierkv.engine import KVLayout, allocate_kv_cache, open_kv_cache
    from tierkv.wire.protocol import TransferJob
    from workers.gpu.transfer import TransferEngine

    instance = f"gc{os.getpid()}"
    layout = KVLayout.per_layer(3, 32, 3, 1, 5, "int8")  # odd pieces of 15 bytes
    with SharedRegion.create(instance, 24, layout.page_size) as region, \
            allocate_kv_cache(instance, 0, layout) as cache, \
            open_kv_cache(cache.registration()) as kv, TransferEngine(region, 0) as engine:
        engine.attach(kv)
        rng = np.random.default_rng(0)
        for t in cache.tensors:
            t.view(-1).copy_(torch.from_numpy(rng.integers(-128, 127, t.numel(), dtype=np.int8)))
        before = [t.clone() for t in cache.tensors]
        gpu, cpu = rng.permutation(32)[:20].tolist(), rng.permutation(24)[:20].tolist()
        engine.submit(TransferJob(1, "store", gpu, cpu))
        assert [o.success for o in engine.wait(30)] == [True]
        for t in cache.tensors:  # only once the store is done: it copies asynchronously
            t.zero_()
        engine.submit(TransferJob(2, "load", gpu, cpu))
        assert [o.success for o in engine.wait(30)] == [True]
        for b, t in zip(before, cache.tensors, strict=True):
            assert (b[:, gpu] == t[:, gpu]).all(), "a block differs after the round trip"
        del before, b, t  # no view of the segment may outlive it
        engine.detach()


def pytest_gpu() -> None:
    checkout = os.environ.get("TIERKV_CHECKOUT", os.getcwd())
    left = max(30, int(BUDGET_S - (time.monotonic() - START) - 60))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "--rootdir", checkout, os.path.join(checkout, "tests", "gpu")],
                          timeout=left, cwd=os.getcwd())
    if done.returncode != 0:
        raise AssertionError(f"pytest tests/gpu exited {done.returncode}")


def main() -> int:
    import torch

    from workers.gpu.check import environment as env_report

    part("environment", lambda: env_report.host(say), correctness=False)
    part("CPU engine round trip", cpu_round_trip)
    if not torch.cuda.is_available():
        say("no CUDA: skipping the device part")
    else:
        from workers.gpu.check import measure

        part("GPUs", lambda: env_report.gpus(say), correctness=False)
        part("per backend", lambda: measure.backend_facts(say))
        part("pin and unpin 16 GiB", lambda: measure.pin_timing(say), correctness=False)
        from workers.gpu.check import ordering

        part("copies ordered after the model (store, load)", lambda: ordering.ordered(say))
        part("the same race without the ordering (control)", lambda: ordering.control(say),
             correctness=False)
        part("pytest tests/gpu", pytest_gpu)
        end = START + BUDGET_S - 45
        part("bandwidth vs pinned cudaMemcpyAsync (1000 blocks)",
             lambda: measure.bandwidth(say, end), correctness=False)
        if time.monotonic() < START + BUDGET_S - 40:
            part("under load: beside a matmul process", lambda: measure.under_load(say),
                 correctness=False)
        if time.monotonic() < START + BUDGET_S - 15:
            with tempfile.TemporaryDirectory() as tmp:
                part("the worker's own GPU memory", lambda: measure.worker_memory(say, tmp),
                     correctness=False)
    say("== summary")
    for name, ok, _ in RESULTS:
        say(f"  {'PASS' if ok else 'FAIL'}  {name}")
    if any(not ok for _, ok, correct in RESULTS if correct):
        return 1
    return 0 if all(ok for _, ok, _ in RESULTS) else 2


if __name__ == "__main__":
    sys.exit(main())
