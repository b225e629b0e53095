"""Which GPU blocks the jobs in flight read and write: the part of the engine
contract a worker can check (see `workers.gpu.transfer`).

A store reads its GPU blocks, a load writes them, and the two directions run on
separate streams. A load into a block that a store in flight still reads would
overwrite it under the store; a store of a block that a load in flight is still
writing would save half-written bytes. Both are refused before anything is copied.
Counts per block, so a store that reads one block into several CPU blocks, or
several jobs over one block, are counted exactly.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tierkv.core.errors import ErrorCode
from workers.gpu.jobs import JobError


class BlockUse:
    """Reads and writes of the GPU blocks by the jobs in flight. Main thread only."""

    def __init__(self, num_blocks: int) -> None:
        self._reads = np.zeros(num_blocks, dtype=np.int32)  # by stores in flight
        self._writes = np.zeros(num_blocks, dtype=np.int32)  # by loads in flight
        self._jobs: defaultdict[int, list[tuple[str, np.ndarray]]] = defaultdict(list)

    def check(self, job_id: int, direction: str, gpu: np.ndarray) -> None:
        """Raise JobError (bad_request) if `gpu` conflicts with a job in flight."""
        if direction == "load":
            busy, why = gpu[self._reads[gpu] > 0], "a store in flight still reads it"
        else:
            busy, why = gpu[self._writes[gpu] > 0], "a load in flight is still writing it"
        if len(busy):
            raise JobError(
                ErrorCode.BAD_REQUEST,
                f"job {job_id}: {direction} of GPU block {int(busy[0])} refused: {why} (load "
                "only into blocks allocated for the request and not yet computed; store only "
                "blocks whose step finished, and wait for a load before storing its blocks)",
            )

    def hold(self, job_id: int, direction: str, gpu: np.ndarray) -> None:
        np.add.at(self._reads if direction == "store" else self._writes, gpu, 1)
        self._jobs[job_id].append((direction, gpu))

    def release(self, job_id: int) -> None:
        """The job finished (or failed): its blocks are free again. Unknown ids are
        ignored (a job that failed before it held anything)."""
        held = self._jobs.get(job_id)
        if not held:
            return
        direction, gpu = held.pop(0)
        if not held:
            del self._jobs[job_id]
        np.subtract.at(self._reads if direction == "store" else self._writes, gpu, 1)

    @property
    def idle(self) -> bool:
        return not self._jobs
