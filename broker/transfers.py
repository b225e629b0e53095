"""GPU transfer jobs in flight: a job is finished when every rank has reported,
failed if any rank failed. Socket-free; the broker core drives it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.core.keys import OffloadKey
from tierkv.wire.protocol import TransferOutcome, TransferResult


@dataclass(eq=False)
class Transfer:
    job_id: int
    kind: str  # "store" | "load"
    keys: list[OffloadKey]
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    client: bytes  # who asked, and gets the result
    deadline: float
    pending_ranks: set[int]
    error_code: str = ""
    error: str = ""
    bytes_moved: int = 0
    seconds: float = 0.0
    done_ranks: set[int] = field(default_factory=set)

    @property
    def success(self) -> bool:
        return not self.error_code

    def result(self) -> TransferResult:
        return TransferResult(self.job_id, self.kind, self.success, self.error_code, self.error)


class TransferTracker:
    def __init__(self) -> None:
        self.jobs: dict[int, Transfer] = {}

    def start(self, transfer: Transfer) -> None:
        self.jobs[transfer.job_id] = transfer

    def rank_done(self, rank: int, outcome: TransferOutcome) -> Transfer | None:
        """Record one rank's outcome; the transfer once every rank reported.
        Unknown jobs and ranks that owe nothing return None (late or forged)."""
        transfer = self.jobs.get(outcome.job_id)
        if transfer is None or rank not in transfer.pending_ranks:
            return None
        transfer.pending_ranks.discard(rank)
        transfer.done_ranks.add(rank)
        transfer.bytes_moved += outcome.bytes_moved
        transfer.seconds = max(transfer.seconds, outcome.seconds)
        if not outcome.success and not transfer.error_code:
            transfer.error_code = outcome.error_code or "fatal"
            transfer.error = f"rank {rank}: {outcome.error}"
        if transfer.pending_ranks:
            return None
        return self.jobs.pop(transfer.job_id)

    def fail_rank(self, rank: int, code: str, reason: str) -> list[Transfer]:
        """Every job still waiting for `rank` fails (the worker died)."""
        finished = []
        for transfer in list(self.jobs.values()):
            if rank in transfer.pending_ranks:
                outcome = TransferOutcome(transfer.job_id, False, code, reason)
                done = self.rank_done(rank, outcome)
                if done is not None:
                    finished.append(done)
        return finished

    def overdue(self, now: float, grace_s: float = 0.0) -> list[Transfer]:
        """Jobs `grace_s` past their deadline (a live worker fails a late job itself
        and reports it within the grace; only a hung one does not)."""
        return [t for t in self.jobs.values() if t.deadline and now > t.deadline + grace_s]

    def credit(self, gap: float) -> None:
        """The broker did not listen for `gap` seconds: its deadlines move with it."""
        for transfer in self.jobs.values():
            if transfer.deadline:
                transfer.deadline += gap

    def __len__(self) -> int:
        return len(self.jobs)
