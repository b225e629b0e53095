"""gpu-check's measurements on a GPU: per backend facts, pinning time, bandwidth of
store and load against one pinned cudaMemcpyAsync of the same bytes between the
registered region and the device (device time beside wall time, DMA calls per job,
CPU time), the same beside another process's matmul loop, and the worker's own GPU
memory. Figures are printed, never asserted: the goals are read off the ratios."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tierkv.bench.copy_engine import block_ids, capacity, make_layout
from tierkv.core.shm import SharedRegion
from tierkv.engine import KVCache, KVLayout, OpenedKV
from tierkv.wire.protocol import TransferJob
from workers.gpu.transfer import TransferEngine

Say = Callable[..., None]
_IDS = iter(range(1, 1 << 62))


def _instance() -> str:
    return f"gc{uuid.uuid4().hex[:8]}"


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _kv(layout: KVLayout, device: str = "cuda") -> OpenedKV:
    tensors = [torch.empty(s, dtype=layout.torch_dtype(), device=device)
               for s in layout.tensor_shapes]
    for t in tensors:
        t.view(torch.uint8).random_(0, 256)
    return OpenedKV.local(tensors, layout)


def _job(engine: TransferEngine, direction: str, gpu: list[int], cpu: list[int]) -> Any:
    engine.submit(TransferJob(next(_IDS), direction, gpu, cpu))
    (out,) = engine.wait(timeout=120)
    if not out.success:
        raise RuntimeError(f"{direction} failed: {out.error_code}: {out.error}")
    return out


# -- per backend facts, pinning ----------------------------------------------------------------


def backend_facts(say: Say) -> None:
    """Attach each layout at world size 1 and 2 and say what the backend chose."""
    layouts = {"per_layer": KVLayout.per_layer(4, 64, 16, 2, 64, "bfloat16"),
               "blocks_outer": KVLayout.blocks_outer(64, 3, 4, 2, 64, "float16"),
               "odd": KVLayout.per_layer(3, 64, 3, 1, 5, "int8")}
    for name, layout in layouts.items():
        for ws in (1, 2):
            with SharedRegion.create(_instance(), 48, layout.page_size, ws) as region, \
                    TransferEngine(region, ws - 1, "cuda") as engine:
                engine.attach(_kv(layout))
                _job(engine, "store", list(range(10)), list(range(10)))
                f = engine.describe()
                why = f"  ({f['dma_reason']})" if f["dma_reason"] else ""
                say(f"  {name:12s} ws={ws} page {layout.page_size:6d} B: pinned={f['pinned']} "
                    f"dma={f['dma_path']} word={f['word']} chunk={f['chunk_blocks']} blocks "
                    f"x {f['staging_buffers']}{why}")


def pin_timing(say: Say, gib: int = 16) -> None:
    """Pin and unpin a prefaulted region of `gib` GiB (fewer if /dev/shm lacks room)."""
    from workers.gpu.pinning import pin_host, unpin_host

    st = os.statvfs("/dev/shm")
    size = min(gib << 30, (st.f_bavail * st.f_frsize // 2) & ~((1 << 21) - 1))
    if size < gib << 30:
        say(f"  only {size / 2**30:.1f} GiB of /dev/shm to spare: timing that instead")
    with SharedRegion.create(_instance(), size >> 21, 1 << 21) as region:
        view = region.torch_view()
        started = time.perf_counter()
        region.numpy().reshape(-1)[:: 4096] = 1  # fault every page in, as the broker does
        faulted = time.perf_counter() - started
        pinned = pin_host(view.data_ptr(), view.numel(), torch.cuda.current_device())
        unpin = unpin_host(view.data_ptr(), torch.cuda.current_device())
        del view
    say(f"  {size / 2**30:.1f} GiB: prefault {faulted:.2f} s, pin {pinned.seconds:.2f} s "
        f"({'ok' if pinned.pinned else pinned.error}), unpin {unpin:.2f} s")


# -- bandwidth ----------------------------------------------------------------------------------


class Bench:
    """One page size: a region, a KV cache, an engine, and the reference copies
    between the same (registered) region and a device buffer."""

    def __init__(self, page: int, blocks: int, kind: str = "per_layer") -> None:
        self.blocks, self.page, self.total = blocks, page, blocks * page
        self.layout = make_layout(kind, page, capacity(blocks))
        self.region = SharedRegion.create(_instance(), capacity(blocks), page)
        self.region.numpy().reshape(-1)[:: 4096] = 1
        self.engine = TransferEngine(self.region, 0, "cuda")
        self.engine.attach(_kv(self.layout))
        host = self.region.torch_view().view(-1)[: self.total]  # pinned by the engine
        dev = torch.empty(self.total, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.ref = {"store": (host, dev), "load": (dev, host)}

    def reference(self, direction: str) -> tuple[float, float]:
        """(wall s, device s) of one cudaMemcpyAsync of the job's bytes."""
        dst, src = self.ref[direction]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        end.synchronize()
        return time.perf_counter() - t0, start.elapsed_time(end) / 1000

    def engine_job(self, direction: str, gpu: list[int], cpu: list[int]) -> dict[str, float]:
        backend: Any = self.engine._backend  # the CUDA backend: it counts its DMA calls
        calls0 = backend.stats["dma_calls"]
        cpu0, t0 = _cpu_seconds(), time.perf_counter()
        out = _job(self.engine, direction, gpu, cpu)
        wall = time.perf_counter() - t0
        return {"wall": wall, "device": out.seconds, "cpu": _cpu_seconds() - cpu0,
                "calls": backend.stats["dma_calls"] - calls0}

    def close(self) -> None:
        self.engine.close()
        self.ref.clear()
        self.region.close()
        self.region.unlink()


HEADER = (f"{'page':>8s} {'ids':11s} {'dir':5s} {'GB/s wall':>9s} {'dev':>6s} | "
          f"{'ref wall':>8s} {'dev':>6s} | {'ratio wall':>10s} {'dev':>5s} | "
          f"{'DMA calls':>9s} {'CPU %core/(GB/s)':>16s}")


def bandwidth_row(bench: Bench, pattern: str, repeats: int) -> list[str]:
    gpu, cpu = block_ids(pattern, bench.blocks)
    rows = []
    samples: dict[str, list[tuple[float, float, dict[str, float]]]] = {"store": [], "load": []}
    for r in range(repeats + 1):  # the first round warms up
        for direction in ("store", "load"):
            ref = bench.reference(direction)
            eng = bench.engine_job(direction, gpu, cpu)
            if r:
                samples[direction].append((ref[0], ref[1], eng))
    gb = bench.total / 1e9
    for direction, s in samples.items():
        med = statistics.median
        e_wall, e_dev = med(x[2]["wall"] for x in s), med(x[2]["device"] for x in s)
        r_wall, r_dev = med(x[0] for x in s), med(x[1] for x in s)
        calls = med(x[2]["calls"] for x in s)
        cpu_core = med(x[2]["cpu"] / x[2]["wall"] for x in s)  # cores busy during the job
        per_gbs = 100 * cpu_core / (gb / e_wall)
        rows.append(f"{bench.page >> 10:6d}Ki {pattern:11s} {direction:5s} {gb / e_wall:9.1f} "
                    f"{gb / e_dev:6.1f} | {gb / r_wall:8.1f} {gb / r_dev:6.1f} | "
                    f"{r_wall / e_wall:10.2f} {r_dev / e_dev:5.2f} | {calls:9.0f} "
                    f"{per_gbs:16.2f}")
    return rows


def bandwidth(say: Say, budget_end: float, blocks: int = 1000, repeats: int = 5) -> None:
    say("  " + HEADER)
    say("  (ratio = reference time / engine time: 1.0 is the bus; goals >= 0.9 for pages >= "
        "512 KiB, >= 0.7 at 64 KiB; CPU <= 10 %core per GB/s)")
    for page_kib in (64, 512, 2048):
        if time.monotonic() > budget_end:
            say(f"  time budget spent: {page_kib} KiB and larger skipped")
            return
        bench = Bench(page_kib << 10, blocks)
        try:
            for pattern in ("consecutive", "scattered"):
                for row in bandwidth_row(bench, pattern, repeats):
                    say("  " + row)
        finally:
            bench.close()
        torch.cuda.empty_cache()


MATMUL = textwrap.dedent("""
    import sys, time, torch
    seconds = float(sys.argv[1])
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        print(time.monotonic(), flush=True)
""")


def under_load(say: Say, page_kib: int = 512, seconds: float = 4.0) -> None:
    """Bandwidth beside a matmul loop in another process, and the matmul's slowdown:
    its rate while the worker copies against its rate before and after."""
    bench = Bench(page_kib << 10, 1000)
    proc = subprocess.Popen([sys.executable, "-c", MATMUL, str(3 * seconds)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the matmul process did not start")
        time.sleep(seconds)  # matmul alone
        t0 = time.monotonic()
        rows = []
        while time.monotonic() < t0 + seconds:
            rows = bandwidth_row(bench, "scattered", 2)
        t1 = time.monotonic()
        out, _ = proc.communicate(timeout=4 * seconds + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        bench.close()
    stamps = np.array([float(x) for x in out.split()])
    gaps = np.diff(stamps)
    mids = stamps[1:]
    inside = gaps[(mids > t0) & (mids <= t1)]
    outside = gaps[(mids <= t0) | (mids > t1 + 0.5)]
    for row in rows:
        say("  " + row + "   (beside the matmul)")
    if len(inside) and len(outside):
        slowdown = statistics.median(inside) / statistics.median(outside) - 1
        say(f"  matmul: {statistics.median(outside) * 100:.1f} ms per 10 alone, "
            f"{statistics.median(inside) * 100:.1f} ms while copying: slowed by "
            f"{100 * slowdown:.1f} % (goal <= 5 %)")


# -- the worker's own GPU memory ----------------------------------------------------------------


WORKER = textwrap.dedent("""
    import sys, msgpack, torch
    from tierkv.core.shm import SharedRegion
    from tierkv.engine import open_kv_cache
    from tierkv.wire.protocol import TransferJob
    from workers.gpu.transfer import TransferEngine
    instance, path = sys.argv[1], sys.argv[2]
    registration = msgpack.unpackb(open(path, "rb").read(), raw=False)
    torch.cuda.set_device(registration["storages"][0]["device_index"])
    region = SharedRegion.attach(instance)
    kv = open_kv_cache(registration)
    engine = TransferEngine(region, 0, "cuda")
    engine.attach(kv)
    for direction in ("store", "load"):
        engine.submit(TransferJob(1, direction, list(range(64)), list(range(64))))
        assert [o.success for o in engine.wait(60)] == [True]
    print("ready", flush=True)
    sys.stdin.read()
    engine.close(); kv.close(); region.close()
""")


def worker_memory(say: Say, tmp: str) -> None:
    """GPU memory a worker process takes for itself: free memory before it starts and
    once it attached and copied (its context, staging buffers, index tensors)."""
    import msgpack

    layout = make_layout("per_layer", 512 << 10, 128)
    with SharedRegion.create(_instance(), 96, layout.page_size) as region:
        kv = _kv(layout)
        cache = KVCache.from_tensors(kv.tensors, layout)
        path = os.path.join(tmp, "registration.msgpack")
        with open(path, "wb") as f:
            f.write(msgpack.packb(cache.registration(), use_bin_type=True))
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        proc = subprocess.Popen([sys.executable, "-c", WORKER, region.instance, path],
                                stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            ready = proc.stdout.readline().strip() == "ready"
            after = torch.cuda.mem_get_info()[0]
            proc.stdin.close()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        cache.close()
    if not ready:
        raise RuntimeError(f"the worker process failed (exit {proc.returncode})")
    say(f"  worker process: {(before - after) / 2**20:.0f} MiB of GPU memory (mem_get_info "
        f"free {before / 2**30:.2f} GiB before it started, {after / 2**30:.2f} GiB after it "
        "attached and copied)")
