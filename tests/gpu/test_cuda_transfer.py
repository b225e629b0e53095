"""The CUDA backend on a real GPU: bit-exact round trips for both layouts and odd
sizes by every DMA path, two ranks sharing one region, two real worker processes
opening the engine's KV cache by CUDA IPC handle, forced registration failures
followed by a kernel launch, and the IPC reference counts across a worker restart.
Skipped without CUDA."""

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
    # 15-byte pieces: byte words, a 90-byte page
    "odd": lambda: KVLayout.per_layer(3, NUM_BLOCKS, 3, 1, 5, "int8"),
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


@pytest.mark.parametrize("dma", ["batch", "2d", "copy"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_round_trip_in_process(instance, monkeypatch, kind, world_size, dma):
    monkeypatch.setenv("TIERKV_CUDA_DMA", dma)  # granted only if the runtime has it
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


# -- failures that must leave the device usable ------------------------------------------------


def launch_a_kernel() -> None:
    """torch checks CUDA's last error after each launch: a stale one would raise here."""
    x = torch.ones(1024, device="cuda")
    assert float((x * 2).sum().item()) == 2048.0


def test_a_failed_pin_is_cleared_before_the_next_kernel():
    from workers.gpu.pinning import is_pinned, pin_host, unpin_host

    buf = np.zeros(3 << 20, dtype=np.uint8)
    base = buf.ctypes.data
    assert pin_host(base, buf.nbytes).pinned
    inner = pin_host(base + (1 << 20), 1 << 20)  # already registered: CUDA refuses
    assert not inner.pinned and "cudaError" in inner.error
    launch_a_kernel()
    assert is_pinned(base) and is_pinned(base + (1 << 20)) is False
    unpin_host(base + (1 << 20))
    unpin_host(base)
    launch_a_kernel()


def test_a_bad_ipc_handle_fails_registration_cleanly(instance):
    from tierkv.engine import KVCacheError, open_kv_cache

    layout = LAYOUTS["per_layer"]()
    cache = KVCache.from_tensors(cuda_kv(layout, 0), layout)
    registration = cache.registration()
    bad = {**registration, "storages": [
        {**registration["storages"][0], "handle": bytes(len(registration["storages"][0]
                                                             ["handle"]))}]}
    script = textwrap.dedent("""
        import sys, msgpack, torch
        from tierkv.engine import KVCacheError, open_kv_cache
        try:
            open_kv_cache(msgpack.unpackb(sys.stdin.buffer.read(), raw=False))
        except KVCacheError as e:
            print("refused:", e)
        x = torch.ones(8, device="cuda")
        print("kernel", float(x.sum().item()))
    """)
    done = subprocess.run([sys.executable, "-c", script], input=msgpack.packb(
        bad, use_bin_type=True), capture_output=True, timeout=120)
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    assert "refused: cannot open the CUDA IPC handle" in out and "kernel 8.0" in out
    with pytest.raises(KVCacheError, match="another process than the engine"):
        open_kv_cache(registration)  # the exporter itself cannot open its handle
    launch_a_kernel()
    cache.close()


COUNT_CHILD = """
import sys, msgpack
from tierkv.engine import open_kv_cache
from tierkv.engine.ipc import read_counter
registration = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
storage = registration["storages"][0]
kv = open_kv_cache(registration)
print(read_counter(storage["ref_counter"], storage["ref_counter_offset"]))
kv.close()
del kv
import gc; gc.collect()
print(read_counter(storage["ref_counter"], storage["ref_counter_offset"]))
"""


def test_reference_counts_stay_balanced_across_worker_restarts():
    """The same registration opened by a worker, then by its restarted successor:
    each holds one reference while open and gives it back; the engine's own goes
    when it closes its KVCache."""
    from tierkv.engine import KVCacheError
    from tierkv.engine.ipc import read_counter

    layout = LAYOUTS["per_layer"]()
    cache = KVCache.from_tensors(cuda_kv(layout, 0), layout)
    storage = cache.registration()["storages"][0]
    handle, offset = storage["ref_counter"], storage["ref_counter_offset"]
    assert read_counter(handle, offset) == 1
    for _ in range(2):  # a worker, then the restarted one, get the same registration
        done = subprocess.run([sys.executable, "-c", COUNT_CHILD], input=msgpack.packb(
            cache.registration(), use_bin_type=True), capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout.decode().split() == ["2", "1"]
        assert read_counter(handle, offset) == 1
    cache.close()
    try:  # the engine gave its reference back (or torch already dropped the whole file)
        assert read_counter(handle, offset) == 0
    except KVCacheError as e:
        assert "is gone" in str(e)
