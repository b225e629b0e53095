"""`TierkvConnector`: vLLM's `OffloadingConnector`, with what tierkv needs of it.

    --kv-transfer-config '{"kv_connector": "TierkvConnector",
      "kv_connector_module_path": "tierkv.vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "TierkvOffloadingSpec",
        "spec_module_path": "tierkv.vllm", "tierkv_config": "node.toml"}}'

Everything is vLLM's own offloading connector (its scheduler, its worker loop, the
spec it builds by name) but for two things vLLM's offloading interfaces cannot carry:

* **Facts for the namespace.** An `OffloadingSpec` sees only `OffloadingConfig`; the
  model's revision and quantization and the KV specs (which carry the kernel block
  split) are in the configs this connector gets, so it hands them to the spec it
  builds (`tierkv.vllm.identity`).
* **A copy that fails is recomputed.** vLLM's offloading worker asserts every copy
  succeeded, so tierkv's worker reports a failed one as done and tells this connector
  instead: a failed load's GPU blocks are reported through vLLM's connector failure
  path (`get_block_ids_with_load_errors`, or `failed_recving` for a model with more
  than one KV-cache group), and vLLM recomputes them (with ``kv_load_failure_policy``
  "recompute"; "fail", vLLM's default, ends the request with an error instead). A
  failed store travels back in the worker metadata and its rows are aborted, not
  committed: a miss. A failed load of a sync-loading request in a model of several
  groups has no vLLM path: the worker stops the engine, naming the job.
* **A cache reset lets go of its copies' blocks.** vLLM 0.33 tells the manager when
  the workers have reported every job a cache reset flushed (`on_reset_flushed`):
  until then a late copy may still read or write their rows, so their pins and
  reservations are held. vLLM 0.32 has no such call, and they were held until the
  engine stopped: rows reserved for good at each reset, and their blocks pending
  for every engine of the old generation. Under a vLLM without it, this connector
  keeps that fence itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.outputs import KVConnectorOutput

from tierkv.vllm.identity import VllmFacts, vllm_facts_for
from tierkv.vllm.jobs import TierkvLoadStoreSpec

log = logging.getLogger("tierkv.vllm")


@dataclass
class TierkvWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata, and the store jobs a worker could not write."""

    failed_stores: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        failed = set(self.failed_stores)
        failed.update(getattr(other, "failed_stores", ()))
        return TierkvWorkerMetadata(merged.completed_jobs, merged.transfer_stats, failed)


class TierkvConnector(OffloadingConnector):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        facts = VllmFacts.of(vllm_config, kv_cache_config,
                             tuple(get_offloading_group_ids(kv_cache_config)))
        with vllm_facts_for(facts):
            super().__init__(vllm_config, role, kv_cache_config)
        self._single_group = len(kv_cache_config.kv_cache_groups) == 1
        self._store_specs: dict[int, TierkvLoadStoreSpec] = {}  # scheduler: store jobs
        self._load_jobs: dict[int, tuple[str, bool]] = {}  # worker: job -> (req, sync)
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        self._failed_stores: set[int] = set()
        self._reset_fence: dict[int, int] = {}  # scheduler: job flushed by a reset -> reports due
        transfer = vllm_config.kv_transfer_config
        if getattr(transfer, "kv_load_failure_policy", "fail") != "recompute":
            log.info("tierkv: kv_load_failure_policy is not 'recompute': a tierkv copy that "
                     "fails ends its request with an error instead of recomputing it")

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        worker = self.connector_worker.worker if self.connector_worker else None
        if worker is not None and hasattr(worker, "report_failures"):
            worker.report_failures()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, OffloadingConnectorMetadata):
            for job_id, job in connector_metadata.load_jobs.items():
                self._load_jobs[job_id] = (job.req_id, getattr(job, "sync", False))  # 0.33

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        self._take_failures()
        if self._failed_recving:
            results.failed_recving.update(self._failed_recving)
            self._failed_recving.clear()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._take_failures()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        # Always ours when there is any: vLLM merges the ranks' metadata with the
        # first one's `aggregate`, which must keep the others' failed stores.
        meta = super().build_connector_worker_meta()
        if meta is None and not self._failed_stores:
            return None
        base = meta or OffloadingWorkerMetadata()
        failed, self._failed_stores = self._failed_stores, set()
        return TierkvWorkerMetadata(base.completed_jobs, base.transfer_stats, failed)

    def _take_failures(self) -> None:
        worker = self.connector_worker.worker if self.connector_worker else None
        if worker is None or not hasattr(worker, "take_failures"):
            return
        for failure in worker.take_failures():
            if failure.direction == "store":
                self._failed_stores.add(failure.job_id)
                continue
            req_id, sync = self._load_jobs.pop(failure.job_id, ("", False))
            if self._single_group:
                self._load_errors.update(failure.gpu_block_ids)
            elif not sync:
                self._failed_recving.add(req_id)
            else:
                raise RuntimeError(f"tierkv: load job {failure.job_id} of request {req_id} "
                                   f"failed ({failure.why}), and vLLM cannot recompute a sync "
                                   "load of a model with several KV-cache groups")
        for job_id in worker.take_reported():  # type: ignore[attr-defined]
            self._load_jobs.pop(job_id, None)

    # -- scheduler side --------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        # Look the request up now (`TierkvOffloadingManager.prefetch`): vLLM makes a
        # request's keys at its first scan, so they are made here, by vLLM's own code
        # (it appends only keys not made yet).
        scheduler = self.connector_scheduler
        manager = scheduler.manager if scheduler is not None else None
        status = getattr(scheduler, "_req_status", {}).get(request.request_id)
        prefetch = getattr(manager, "prefetch", None)
        if status is None or manager is None or prefetch is None:
            return
        status.update_offload_keys()
        with manager.lock:
            prefetch(status.req_context)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        manager: Any = self.connector_scheduler.manager if self.connector_scheduler else None
        prefill = getattr(manager, "prefill", None)
        if prefill is not None:  # before this step's lookups are sent
            prefill.scheduled(scheduler_output)
            manager.link.client.recompute_rate(prefill.tokens_per_s, manager.key_tokens)
        meta = super().build_connector_meta(scheduler_output)
        if isinstance(meta, OffloadingConnectorMetadata):
            for job_id, job in meta.store_jobs.items():
                if isinstance(job.dst_spec, TierkvLoadStoreSpec):
                    self._store_specs[job_id] = job.dst_spec
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        failed = getattr(meta, "failed_stores", ())
        manager = self.connector_scheduler.manager if self.connector_scheduler else None
        if self._reset_fence and meta is not None:
            self._fence_reports(getattr(meta, "completed_jobs", {}), manager)
        if failed and manager is not None and hasattr(manager, "store_failed"):
            with manager.lock:
                for job_id in failed:
                    spec = self._store_specs.get(job_id)
                    if spec is not None:
                        manager.store_failed(spec)
        super().update_connector_output(connector_output)
        if self._store_specs and manager is not None and hasattr(manager, "storing"):
            # A job's spec is kept until its store ended (every worker reported it).
            for job_id, spec in list(self._store_specs.items()):
                if not manager.storing(spec):
                    del self._store_specs[job_id]

    def has_pending_push_work(self) -> bool:
        # The flush a reset sent must reach the workers and their reports come back.
        return bool(self._reset_fence) or super().has_pending_push_work()

    def reset_cache(self) -> bool | None:
        self._store_specs.clear()
        scheduler = self.connector_scheduler
        if scheduler is None or hasattr(scheduler, "_reset_fence"):
            return super().reset_cache()  # a vLLM that calls `on_reset_flushed` itself
        fenced = {job_id: job.pending_count for job_id, job in scheduler._jobs.items()}
        result = super().reset_cache()
        self._reset_fence.update(fenced)
        if not self._reset_fence:
            self._reset_flushed(scheduler.manager)
        return result

    def _fence_reports(self, completed: dict[int, int], manager: Any) -> None:
        """Count the workers' reports of jobs a reset flushed; once every one is in,
        the manager lets go of their blocks."""
        fence = self._reset_fence
        for job_id, count in completed.items():
            left = fence.get(job_id)
            if left is None:
                continue
            if left > count:
                fence[job_id] = left - count
            else:
                del fence[job_id]
        if not fence:
            self._reset_flushed(manager)

    @staticmethod
    def _reset_flushed(manager: Any) -> None:
        if manager is not None and hasattr(manager, "on_reset_flushed"):
            with manager.lock:
                manager.on_reset_flushed()
