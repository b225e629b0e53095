"""One transfer job, checked: the errors it can fail with, the id arithmetic every
copy backend shares (runs of consecutive ids), and the validation that turns a bad
job into a `TransferOutcome` instead of an exception in the worker's loop."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from tierkv.core.errors import ErrorCode
from tierkv.wire.protocol import TransferJob, TransferOutcome

if TYPE_CHECKING:
    from tierkv.engine import OpenedKV

DIRECTIONS = ("store", "load")


class TransferError(RuntimeError):
    """The engine cannot be set up as asked (attach, device); the message says why."""


class JobError(Exception):
    """Why one job fails; becomes a `TransferOutcome`, never escapes the engine."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def failed(job_id: int, code: ErrorCode, message: str) -> TransferOutcome:
    return TransferOutcome(job_id=job_id, success=False, error_code=code.value, error=message)


def runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the maximal runs of consecutive ids (``ids[k+1] ==
    ids[k] + 1``) in `ids`, in order."""
    if len(ids) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ids)]))
    return starts, ends - starts


def check_deadline(job: TransferJob, now: float | None = None) -> None:
    if job.deadline and (time.monotonic() if now is None else now) >= job.deadline:
        raise JobError(
            ErrorCode.TIMEOUT,
            f"job {job.job_id}: its deadline passed before it started "
            f"({time.monotonic() - job.deadline:.3f} s ago)",
        )


def validate(
    job: TransferJob, kv: OpenedKV | None, cpu_blocks: int
) -> tuple[np.ndarray, np.ndarray]:
    """Check a job against the attached KV cache and the region; the ids as int64
    arrays (gpu, cpu). Raises JobError."""
    if job.direction not in DIRECTIONS:
        raise JobError(ErrorCode.BAD_REQUEST, f"job {job.job_id}: direction {job.direction!r}")
    if kv is None or kv.closed:
        raise JobError(
            ErrorCode.UNAVAILABLE, f"job {job.job_id}: no KV cache is attached (engine not "
            "registered yet, or it restarted)"
        )
    if len(job.gpu_block_ids) != len(job.cpu_block_ids):
        raise JobError(
            ErrorCode.BAD_REQUEST,
            f"job {job.job_id}: {len(job.gpu_block_ids)} gpu ids but "
            f"{len(job.cpu_block_ids)} cpu ids",
        )
    try:
        gpu = np.asarray(job.gpu_block_ids, dtype=np.int64).reshape(-1)
        cpu = np.asarray(job.cpu_block_ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise JobError(ErrorCode.BAD_REQUEST, f"job {job.job_id}: block ids: {e}") from None
    _check_range(job.job_id, "gpu", gpu, kv.layout.num_blocks)
    _check_range(job.job_id, "cpu", cpu, cpu_blocks)
    dest, name = (cpu, "cpu") if job.direction == "store" else (gpu, "gpu")
    if _has_duplicates(dest):
        raise JobError(
            ErrorCode.BAD_REQUEST, f"job {job.job_id}: a {name} block id is a destination twice"
        )
    check_deadline(job)
    return gpu, cpu


def _has_duplicates(ids: np.ndarray) -> bool:
    """Whether an id occurs twice. A sort and one compare: `np.unique` costs the
    same but imports `numpy.ma` on its first call (~0.2 s, in the first job)."""
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


def _check_range(job_id: int, name: str, ids: np.ndarray, limit: int) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= limit):
        bad = int(ids[(ids < 0) | (ids >= limit)][0])
        raise JobError(
            ErrorCode.BAD_REQUEST,
            f"job {job_id}: {name} block id {bad} out of range [0, {limit})",
        )
