"""gpu-check's ordering part: copies submitted while the model is still writing.

Inside the engine's process (vLLM) a step's transfers are submitted right after its
forward pass was launched, on the same thread. The CUDA copy path must order each
job after the work queued on the submitter's current stream
(`workers.gpu.copy_cuda`); without that, a store copies half-written KV and a
zeroing queued before a load wipes the loaded blocks, silently.

Each race is set up the way vLLM runs into it: a model-like chain of in-place ops
on the whole KV cache is queued on the current stream (long enough on the device
that the host is far ahead of it), then, without any synchronization:

* store: the job is submitted; once done, the stored rows must equal the blocks'
  final values (every step of the chain changes every byte, so a copy made before
  the chain ended differs);
* load: the target blocks are zeroed after the chain, then the job is submitted;
  the loaded blocks must equal the rows (a zeroing run after the scatter leaves 0s).

The same races are run once more with the wait taken out (`Unordered`, through
the stream seam) as a control: there they must show, or this device cannot tell
the difference and the check proves less (said, and the control part fails).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tierkv.core.shm import SharedRegion
from tierkv.engine import KVLayout, OpenedKV
from tierkv.wire.protocol import TransferJob
from workers.gpu.streams import StreamOps, TorchStreams
from workers.gpu.transfer import TransferEngine

Say = Callable[..., None]

#: 16384 blocks of 32 KiB: a 512 MiB KV cache, so that each step of the chain takes
#: tens of microseconds of device time while its launch takes a few.
NUM_BLOCKS = 16384
#: Steps of the chain: each adds 1 to every byte (so < 256: no step repeats the
#: final value). 200 x 4 layers of 128 MiB: tens of milliseconds on any GPU, while
#: the job's copies take well under one.
STEPS = 200
JOB_BLOCKS = 256
WAIT_S = 60.0


class Unordered(TorchStreams):
    """Torch's stream calls, except that the caller's stream is a private idle one:
    the copy path's wait for the caller becomes a no-op (the code before the fix)."""

    def __init__(self) -> None:
        self._idle: dict[torch.device, Any] = {}

    def current_stream(self, device: torch.device) -> Any:
        if device not in self._idle:
            self._idle[device] = torch.cuda.Stream(device)
        return self._idle[device]


def _layout() -> KVLayout:
    return KVLayout.per_layer(4, NUM_BLOCKS, 16, 2, 64, "bfloat16")  # 32 KiB pages


def _model_writes(kv: OpenedKV) -> None:
    """The forward pass, as far as the KV cache sees it: in-place writes of every
    block, layer by layer, queued on the current stream."""
    views = [t.view(torch.uint8) for t in kv.tensors]
    for _ in range(STEPS):
        for v in views:
            v.add_(1)


def _pages(kv: OpenedKV, blocks: list[int]) -> np.ndarray:
    """The blocks' pages as the CPU tier lays them out, ``(len(blocks), page)``."""
    index = torch.tensor(blocks, device=kv.device)
    parts = [v.index_select(1, index).permute(1, 0, 2).reshape(len(blocks), -1)
             for v in kv.block_views()]
    return torch.cat(parts, dim=1).cpu().numpy()


def _wrong(a: np.ndarray, b: np.ndarray) -> int:
    """Pages (rows) that differ in any byte."""
    return int((a != b).any(axis=1).sum())


class _Race:
    """One KV cache, one region and one engine (with `streams`), for both races."""

    def __init__(self, streams: StreamOps | None) -> None:
        layout = _layout()
        self.region = SharedRegion.create(f"go{uuid.uuid4().hex[:8]}", JOB_BLOCKS,
                                          layout.page_size)
        tensors = [torch.empty(s, dtype=layout.torch_dtype(), device="cuda")
                   for s in layout.tensor_shapes]
        for t in tensors:
            t.view(torch.uint8).random_(0, 256)
        self.kv = OpenedKV.local(tensors, layout)
        rng = np.random.default_rng(7)
        self.gpu = rng.permutation(NUM_BLOCKS)[:JOB_BLOCKS].tolist()
        self.target = rng.permutation(NUM_BLOCKS)[:JOB_BLOCKS].tolist()
        self.rows = rng.permutation(JOB_BLOCKS).tolist()
        # Made now: a pageable host-to-device copy queued behind the chain could wait for it.
        self.target_index = torch.tensor(self.target, device=self.kv.device)
        self._ids = iter(range(1, 1 << 30))
        try:
            self.engine = TransferEngine(self.region, 0, "cuda", streams=streams)
            self.engine.attach(self.kv)
        except BaseException:
            self.kv.close()
            self.region.close()
            self.region.unlink()
            raise
        for direction in ("store", "load"):  # warm the allocators: nothing syncs later
            self._copy(direction, self.target)
        torch.cuda.synchronize()

    def _copy(self, direction: str, blocks: list[int]) -> None:
        """Submit one job (on the calling thread, its current stream as it is) and
        wait for it on the host, as the engine sees its completion."""
        job_id = next(self._ids)
        self.engine.submit(TransferJob(job_id, direction, blocks, self.rows))
        out = self.engine.wait(timeout=WAIT_S)
        if [(o.job_id, o.success) for o in out] != [(job_id, True)]:
            raise RuntimeError(f"{direction} job {job_id} failed or did not finish within "
                               f"{WAIT_S:.0f} s: {out}")

    def store(self) -> int:
        """Blocks stored with other bytes than their final ones, while the model was
        still writing them at submit."""
        _model_writes(self.kv)
        self._copy("store", self.gpu)
        torch.cuda.synchronize()
        stored = self.region.numpy()[self.rows, : self.region.layout.page_size]
        return _wrong(stored, _pages(self.kv, self.gpu))

    def load(self) -> int:
        """Blocks that do not hold their rows after a load submitted while a zeroing
        of them (behind the model's writes) was still queued."""
        _model_writes(self.kv)
        for v in self.kv.block_views():
            v.index_fill_(1, self.target_index, 0)
        self._copy("load", self.target)
        torch.cuda.synchronize()
        rows = self.region.numpy()[self.rows, : self.region.layout.page_size]
        return _wrong(_pages(self.kv, self.target), rows)

    def close(self) -> None:
        self.engine.close()
        self.kv.close()
        self.region.close()
        self.region.unlink()


def races(streams: StreamOps | None = None) -> dict[str, int]:
    """Wrong blocks (of `JOB_BLOCKS`) per direction, with the engine's stream calls
    (None: torch's, as in production)."""
    race = _Race(streams)  # the store race runs first: it fills the rows the load reads
    try:
        return {"store": race.store(), "load": race.load()}
    finally:
        race.close()
        torch.cuda.empty_cache()


def ordered(say: Say) -> None:
    """Correctness: the engine as it ships stores final bytes and keeps its loads."""
    wrong = races()
    say(f"  store while the model writes: {wrong['store']} of {JOB_BLOCKS} blocks wrong; "
        f"load behind a zeroing: {wrong['load']} of {JOB_BLOCKS} wrong")
    if any(wrong.values()):
        raise AssertionError(f"copies not ordered after the caller's stream: {wrong}")


def control(say: Say) -> None:
    """The same races without the wait: they must show, or this check cannot tell."""
    wrong = races(Unordered())
    say(f"  without the wait: store {wrong['store']}, load {wrong['load']} of "
        f"{JOB_BLOCKS} blocks wrong (the race the ordering prevents)")
    if not all(wrong.values()):
        raise AssertionError("the race did not show without the wait on this device: the "
                             "ordering part above cannot tell a missing wait here")
