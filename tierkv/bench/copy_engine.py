"""Bandwidth of the transfer engine against a plain copy of the same bytes.

CPU: the engine's store and load of N blocks (CPU KV cache in shared memory <-> the
CPU tier) against one single-threaded ``np.copyto`` of the same total bytes between
the same two buffers. CUDA (when present): the CUDA backend against one pinned
``cudaMemcpyAsync`` (torch ``copy_(non_blocking=True)``) of the same total bytes.
Each repeat times the reference and the engine back to back and the ratio is taken
per repeat, so a noisy machine moves both; medians of the repeats are printed with
their min-max.

    python -m tierkv.bench.copy_engine                 # CPU, and CUDA when present
    python -m tierkv.bench.copy_engine --pages 256 --repeats 9 --no-cuda

Block ids: the KV cache and the CPU tier hold 1.5 N blocks each, and a job moves N
of them. "consecutive": ids 0..N-1 on both sides (the CPU-tier allocator hands out
consecutive ids, and a fresh request's GPU blocks often are); "scattered": N random
ids of the 1.5 N on each side, in random order (sorted, the runs average ~3 blocks:
the worst case); "mixed": consecutive CPU ids, scattered GPU ids.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from tierkv.core.shm import SharedRegion
from tierkv.engine import KVCache, KVLayout, OpenedKV, allocate_kv_cache, open_kv_cache
from tierkv.wire.protocol import TransferJob
from workers.gpu.transfer import TransferEngine

PATTERNS = ("consecutive", "mixed", "scattered")
NUM_LAYERS = 32
_JOB_IDS = itertools.count(1)


def say(*args: object) -> None:
    print(*args, flush=True)


def make_layout(kind: str, page_size: int, num_blocks: int, dtype: str = "float16") -> KVLayout:
    """A per_layer (NUM_LAYERS layers) or blocks_outer layout whose page is exactly
    `page_size` bytes: 16-token blocks, head_dim up to 128."""
    itemsize = 2 if dtype in ("float16", "bfloat16") else 1
    elems = page_size // (2 * NUM_LAYERS * itemsize)  # per layer, per K or V
    block_size = 16 if elems % 16 == 0 else 1
    rest = elems // block_size
    head_dim = max(d for d in (128, 64, 32, 16, 8, 4, 2, 1) if rest % d == 0)
    heads = rest // head_dim
    if kind == "per_layer":
        layout = KVLayout.per_layer(NUM_LAYERS, num_blocks, block_size, heads, head_dim, dtype)
    else:
        layout = KVLayout.blocks_outer(num_blocks, NUM_LAYERS, block_size, heads, head_dim, dtype)
    if layout.page_size != page_size:
        raise ValueError(f"cannot make a {kind} layout of exactly {page_size} bytes")
    return layout


def capacity(n: int) -> int:
    """Blocks of the KV cache and of the region for jobs of n blocks."""
    return n + n // 2


def block_ids(pattern: str, n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(gpu ids, cpu ids) of one job of n blocks among capacity(n)."""
    rng = np.random.default_rng(seed)
    seq = list(range(n))
    scattered = [rng.permutation(capacity(n))[:n].tolist() for _ in range(2)]
    if pattern == "consecutive":
        return seq, seq
    if pattern == "mixed":
        return scattered[0], seq
    return scattered[0], scattered[1]


@dataclass
class Row:
    backend: str
    layout: str
    page_kib: int
    pattern: str
    direction: str
    nbytes: int
    engine_s: list[float]
    ref_s: list[float]

    def line(self) -> str:
        gbs = [self.nbytes / t / 1e9 for t in self.engine_s]
        ref = [self.nbytes / t / 1e9 for t in self.ref_s]
        ratio = [r / e for e, r in zip(self.engine_s, self.ref_s, strict=True)]
        return (
            f"{self.backend:5s} {self.layout:16s} {self.page_kib:5d} KiB {self.pattern:12s} "
            f"{self.direction:5s} {_fmt(gbs)}  {_fmt(ref)}  {_fmt(ratio, 2)}"
        )


def _fmt(values: list[float], digits: int = 1) -> str:
    med = statistics.median(values)
    return f"{med:6.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})".ljust(22)


HEADER = (
    f"{'dev':5s} {'layout':16s} {'page':>9s} {'ids':12s} {'dir':5s} "
    f"{'engine GB/s (min-max)':22s}  {'reference GB/s':22s}  {'ratio (min-max)':22s}"
)


def run_job(engine: TransferEngine, direction: str, gpu: list[int], cpu: list[int]) -> float:
    """Seconds from submit until the outcome is seen (what the broker waits)."""
    job = TransferJob(next(_JOB_IDS), direction, gpu, cpu)
    t0 = time.perf_counter()
    engine.submit(job)
    (outcome,) = engine.wait(timeout=120)
    elapsed = time.perf_counter() - t0
    if not outcome.success:
        raise RuntimeError(f"{direction} job failed: {outcome.error_code}: {outcome.error}")
    return elapsed


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired(
    engine: TransferEngine, refs: Mapping[str, Callable[[], object]], gpu: list[int],
    cpu: list[int],
    repeats: int,
) -> dict[str, tuple[list[float], list[float]]]:
    """Per direction: (engine seconds, reference seconds), interleaved per repeat."""
    out: dict[str, tuple[list[float], list[float]]] = {"store": ([], []), "load": ([], [])}
    for r in range(repeats + 1):  # the first round warms caches and page tables
        for direction in ("store", "load"):
            ref = timed(refs[direction])
            eng = run_job(engine, direction, gpu, cpu)
            if r:
                out[direction][0].append(eng)
                out[direction][1].append(ref)
    return out


# -- CPU ------------------------------------------------------------------------------------


def bench_cpu(kind: str, page: int, blocks: int, patterns: list[str], repeats: int) -> list[Row]:
    layout = make_layout(kind, page, capacity(blocks))
    instance = f"bench{uuid.uuid4().hex[:8]}"
    rows = []
    refs: dict[str, Callable[[], object]] = {}
    with SharedRegion.create(instance, capacity(blocks), page) as region, \
            allocate_kv_cache(instance, 0, layout) as kv:
        opened = open_kv_cache(kv.registration())
        engine = TransferEngine(region, 0, "cpu")
        try:
            engine.attach(opened)
            total = blocks * page
            refs = _flat_copies(kv, region, total)
            for pattern in patterns:
                gpu, cpu = block_ids(pattern, blocks)
                times = paired(engine, refs, gpu, cpu, repeats)
                for direction, (eng, ref) in times.items():
                    rows.append(Row("cpu", kind, page >> 10, pattern, direction, total, eng, ref))
                    say(rows[-1].line())
        finally:
            engine.close()
            refs.clear()  # drop the views before the maps close
            opened.close()
    return rows


def _flat_copies(kv: KVCache, region: SharedRegion, total: int
                 ) -> dict[str, Callable[[], object]]:
    """The reference copies: one np.copyto of `total` bytes between the KV cache's
    segment and the region's rows, each way."""
    seg = torch.empty(0, dtype=torch.uint8).set_(kv.tensors[0].untyped_storage())
    kv_flat = seg.numpy()[:total]
    region_flat = region.numpy().reshape(-1)[:total]
    kv_flat.fill(7)  # fault every page in before timing
    region_flat.fill(0)
    return {
        "store": functools.partial(np.copyto, region_flat, kv_flat),
        "load": functools.partial(np.copyto, kv_flat, region_flat),
    }


# -- CUDA -----------------------------------------------------------------------------------


def bench_cuda(kind: str, page: int, blocks: int, patterns: list[str], repeats: int,
               device: str = "cuda", world_size: int = 1) -> list[Row]:
    """The CUDA backend (rank 0 of `world_size`: world_size > 1 makes the CPU-tier
    rows strided, moved by cudaMemcpy2DAsync) against one pinned copy."""
    layout = make_layout(kind, page, capacity(blocks))
    instance = f"bench{uuid.uuid4().hex[:8]}"
    total = blocks * page
    tensors = [torch.empty(s, dtype=torch.float16, device=device) for s in layout.tensor_shapes]
    for t in tensors:
        t.view(torch.uint8).random_(0, 256)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)

    def pinned_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()

    refs = {
        "store": lambda: pinned_copy(host, dev),
        "load": lambda: pinned_copy(dev, host),
    }
    rows = []
    with SharedRegion.create(instance, capacity(blocks), page, world_size) as region:
        engine = TransferEngine(region, 0, "cuda")
        try:
            engine.attach(OpenedKV.local(tensors, layout))
            for pattern in patterns:
                gpu, cpu = block_ids(pattern, blocks)
                times = paired(engine, refs, gpu, cpu, repeats)
                name = kind if world_size == 1 else f"{kind}/ws{world_size}"
                for direction, (eng, ref) in times.items():
                    rows.append(Row("cuda", name, page >> 10, pattern, direction, total, eng, ref))
                    say(rows[-1].line())
        finally:
            engine.close()
    refs.clear()
    tensors.clear()
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", default="64,256,2048", help="page sizes in KiB (CPU)")
    p.add_argument("--cuda-pages", default="64,256,2048", help="page sizes in KiB (CUDA)")
    p.add_argument("--blocks", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--patterns", default="consecutive,scattered")
    p.add_argument("--layouts", default="per_layer,blocks_outer")
    p.add_argument("--no-cuda", action="store_true")
    p.add_argument("--no-cpu", action="store_true")
    p.add_argument("--budget", type=float, default=80.0,
                   help="seconds for the CPU part; sizes left when it is spent are skipped")
    args = p.parse_args(argv)
    patterns = [x for x in args.patterns.split(",") if x]
    layouts = [x for x in args.layouts.split(",") if x]
    for x in patterns:
        if x not in PATTERNS:
            p.error(f"unknown pattern {x!r}; known: {PATTERNS}")
    torch.set_num_threads(1)
    say(f"# {args.blocks} blocks per job, {args.repeats} repeats, per_layer = {NUM_LAYERS} "
        f"layers; torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    say(HEADER)
    start = time.monotonic()
    if not args.no_cpu:
        for page_kib in (int(x) for x in args.pages.split(",")):
            for kind in layouts:
                if time.monotonic() - start > args.budget:
                    say(f"# budget of {args.budget:.0f} s spent: {kind} {page_kib} KiB skipped")
                    continue
                bench_cpu(kind, page_kib << 10, args.blocks, patterns, args.repeats)
    if args.no_cuda:
        return 0
    if not torch.cuda.is_available():
        say("# no CUDA: CUDA backend not measured")
        return 0
    say(f"# CUDA: {torch.cuda.get_device_name()}; reference = one pinned cudaMemcpyAsync")
    for page_kib in (int(x) for x in args.cuda_pages.split(",")):
        for kind in layouts:
            bench_cuda(kind, page_kib << 10, args.blocks, patterns, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
