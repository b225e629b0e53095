"""The CUDA backend on a real GPU: bit-exact round trips for both layouts, two ranks
sharing one region, and two real worker processes opening the engine's KV cache by
CUDA IPC handle. Skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

import msgpack  # noqa: E402

from tierkv.core.shm import SharedRegion  # noqa: E402
from tierkv.engine import KVCache, KVLayout, OpenedKV  # noqa: E402
from tierkv.wire.protocol import TransferJob  # noqa: E402
from workers.gpu.transfer import TransferEngine  # noqa: E402

NUM_BLOCKS = 64
CPU_BLOCKS = 48

LAYOUTS = {
    # pieces of 16*2*64*2 = 4 KiB: a 4-layer page of 32 KiB
    "per_layer": lambda: KVLayout.per_layer(4, NUM_BLOCKS, 16, 2, 64, "bfloat16"),
    # a 6 KiB slice per block: rows padded to 8 KiB even with one rank (strided DMA)
    "blocks_outer": lambda: KVLayout.blocks_outer(NUM_BLOCKS, 3, 4, 2, 64, "float16"),
}


def cuda_kv(layout: KVLayout, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = []
    for shape in layout.tensor_shapes:
        t = torch.empty(shape, dtype=layout.torch_dtype(), device="cuda")
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8, device="cuda", generator=gen))
        tensors.append(t)
    return tensors


def page_of(tensors: list[torch.Tensor], layout: KVLayout, block: int) -> bytes:
    d = layout.block_dim
    return b"".join(
        t.select(d, block).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        for t in tensors
    )


def zero_blocks(tensors: list[torch.Tensor], layout: KVLayout, blocks: list[int]) -> None:
    index = torch.tensor(blocks, device="cuda")
    for t in tensors:
        t.index_fill_(layout.block_dim, index, 0)
    torch.cuda.synchronize()


def wait_all(engine: TransferEngine, n: int) -> dict:
    out = engine.wait(timeout=60)
    assert len(out) == n and engine.in_flight == 0
    return {o.job_id: o for o in out}


def job_ids(seed: int) -> tuple[list[int], list[int], list[int]]:
    rng = np.random.default_rng(seed)
    gpu = rng.permutation(NUM_BLOCKS)[:40].tolist()
    cpu = [*range(3, 23), *rng.permutation(np.arange(23, CPU_BLOCKS))[:20].tolist()]
    target = rng.permutation(NUM_BLOCKS)[:40].tolist()
    return gpu, cpu, target


@pytest.mark.parametrize("no_2d", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_round_trip_in_process(instance, monkeypatch, kind, world_size, no_2d):
    if no_2d:
        monkeypatch.setenv("TIERKV_CUDA_NO_MEMCPY2D", "1")
    layout = LAYOUTS[kind]()
    gpu, cpu, target = job_ids(world_size)
    with SharedRegion.create(instance, CPU_BLOCKS, layout.page_size, world_size) as region:
        region.numpy()[:] = 0xAB
        kvs = [cuda_kv(layout, seed=r) for r in range(world_size)]
        engines = [TransferEngine(region, r, "cuda", staging_bytes=16 * layout.page_size)
                   for r in range(world_size)]
        try:
            before = [[page_of(kv, layout, g) for g in gpu] for kv in kvs]
            for engine, kv in zip(engines, kvs, strict=True):
                engine.attach(OpenedKV.local(kv, layout))
                engine.submit(TransferJob(1, "store", gpu, cpu))
            for r, engine in enumerate(engines):
                assert wait_all(engine, 1)[1].success
                assert [bytes(region.page(c, r)) for c in cpu] == before[r]
            assert (region.numpy()[:, world_size * layout.page_size:] == 0xAB).all()
            for engine, kv in zip(engines, kvs, strict=True):
                zero_blocks(kv, layout, list(range(NUM_BLOCKS)))
                engine.submit(TransferJob(2, "load", target, cpu))
            for r, engine in enumerate(engines):
                out = wait_all(engine, 1)[2]
                assert out.success and out.bytes_moved == 40 * layout.page_size
                assert [page_of(kvs[r], layout, g) for g in target] == before[r]
        finally:
            for engine in engines:
                engine.close()


def test_bad_jobs_and_deadline_on_cuda(instance):
    layout = LAYOUTS["per_layer"]()
    with SharedRegion.create(instance, CPU_BLOCKS, layout.page_size) as region, \
            TransferEngine(region, 0) as engine:
        engine.attach(OpenedKV.local(cuda_kv(layout, 0), layout))
        engine.submit(TransferJob(1, "store", [NUM_BLOCKS], [0]))
        engine.submit(TransferJob(2, "load", [0], [0], deadline=time.monotonic() - 1))
        engine.submit(TransferJob(3, "store", [1], [1]))
        out = wait_all(engine, 3)
        assert out[1].error_code == "bad_request"
        assert out[2].error_code == "timeout"
        assert out[3].success
        assert not region.numpy()[0].any()


CHILD = """
import sys, msgpack, torch
from tierkv.engine import open_kv_cache
from tierkv.wire.protocol import TransferJob
from tierkv.core.shm import SharedRegion
from workers.gpu.transfer import TransferEngine

instance, rank, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
args = msgpack.unpackb(open(path, "rb").read(), raw=False)
region = SharedRegion.attach(instance)
kv = open_kv_cache(args["registration"])
engine = TransferEngine(region, rank, "cuda")
engine.attach(kv)
engine.submit(TransferJob(1, "store", args["gpu"], args["cpu"]))
out = engine.wait(timeout=60)
assert [o.success for o in out] == [True], out
index = torch.tensor(args["gpu"], device=kv.device)
for t in kv.tensors:  # the engine's memory, seen through the IPC handle
    t.index_fill_(kv.layout.block_dim, index, 0)
torch.cuda.synchronize()
engine.submit(TransferJob(2, "load", args["target"], args["cpu"]))
out = engine.wait(timeout=60)
assert [o.success for o in out] == [True], out
engine.close()
kv.close()
region.close()
print("ok", rank)
"""


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_two_worker_processes_share_one_region(instance, tmp_path, kind):
    """world_size 2 on one device: the engine (this process) exports two KV caches,
    two worker processes open them by IPC handle and copy their rank's pages."""
    layout = LAYOUTS[kind]()
    gpu, cpu, target = job_ids(5)
    with SharedRegion.create(instance, CPU_BLOCKS, layout.page_size, world_size=2) as region:
        region.numpy()[:] = 0xAB
        kvs = [cuda_kv(layout, seed=10 + r) for r in range(2)]
        before = [[page_of(kv, layout, g) for g in gpu] for kv in kvs]
        caches = [KVCache.from_tensors(kv, layout) for kv in kvs]
        torch.cuda.synchronize()
        procs = []
        for r, cache in enumerate(caches):
            path = tmp_path / f"rank{r}.msgpack"
            path.write_bytes(msgpack.packb(
                {"registration": cache.registration(), "gpu": gpu, "cpu": cpu,
                 "target": target}, use_bin_type=True))
            procs.append(subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(CHILD), instance, str(r), str(path)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
        for r, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=180)
            assert proc.returncode == 0, stderr
            assert stdout.split() == ["ok", str(r)]
        for r in range(2):
            assert [bytes(region.page(c, r)) for c in cpu] == before[r]
            assert [page_of(kvs[r], layout, g) for g in target] == before[r]
        assert (region.numpy()[:, 2 * layout.page_size:] == 0xAB).all()
        for cache in caches:
            cache.close()
