"""What the scheduler side tells the worker side about one store or load job.

vLLM carries a job's `LoadStoreSpec` from the scheduler (the manager made it) to
every worker (which copies by it), and back by job id when the job ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec


class TierkvLoadStoreSpec(LoadStoreSpec):
    """Where one job's chunks are in the node's CPU tier: a row per chunk (-1: no
    row, nothing to copy for it), chunks in job order, counted per KV-cache group, and
    the region (`SharedRegion.generation`) the rows belong to.

    A store's spec also names its request and chunks, so that a store the workers
    report failed is aborted, not committed (`TierkvOffloadingManager.store_failed`)."""

    def __init__(self, chunks_per_group: Sequence[int], rows: Sequence[int] = (),
                 region: str = "", req_id: str = "",
                 chunks: Sequence[bytes] = ()) -> None:
        self.chunks_per_group = tuple(chunks_per_group)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.region = region
        self.req_id = req_id
        self.chunks = tuple(chunks)

    def __repr__(self) -> str:
        return f"TierkvLoadStoreSpec(rows={self.rows}, region={self.region!r})"
