"""A CPU-only vLLM engine for tests and benchmarks: vLLM's real `Scheduler` with its
real `OffloadingConnector` in both roles, CPU KV tensors, and a stand-in model.

What is real: vLLM's scheduler, KV-cache manager, prefix cache, the offloading
connector's scheduler and worker sides, and the offloading back end under test
(tierkv's, or vLLM's own manager). What stands in: the model's forward pass. It
"computes" a block by writing bytes derived from the block's hash into every KV
tensor of the block, and before it does, checks that every block the request
already counts as computed holds the bytes of its own hash: a block that vLLM's
prefix cache or an offloading load put there with the wrong bytes is caught
(`Engine.mismatches`). Sampled tokens are a function of the request and position,
so runs are repeatable.

The stand-in model runs as vLLM's model runs on a GPU with async scheduling: a
step launches its forward pass and goes on (`StandInModel`: forward passes run in
launch order on a thread of their own, as kernels run on a stream). A forward pass
writes half of each new block, then waits until the engine has gone on to submit
the next step's transfers (the stores of the blocks it is writing among them),
then writes the rest: every transfer is submitted while the model still writes.
The copies are ordered after it through tierkv's CPU ordering point
(`TierkvOffloadingWorker.order_after`); `order_copies=False` takes the ordering
away and lets the copies finish before the model does (the race, made certain).

Needs vLLM 0.33 (`pip install 'tierkv[vllm]'`); a tiny local model config is
written to a temporary directory (no weights, no network).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

# The configuration, named here too: tests and benchmarks import it from here.
from tierkv.bench.vllm_setup import (  # noqa: E402, F401
    EOS,
    STAND_IN_PREFILL_TPS,
    TINY_MODEL,
    EngineShape,
    engine_node,
    kv_cache_config,
    model_dir,
    node_config,
    tierkv_extra_config,
)

_none_hash_ready = False


# `connector_for` and `vllm_config` live here, not with the rest of the configuration:
# a peer's benchmark driver replaces `vllm_engine.connector_for`, and `vllm_config`
# must call the replacement.
def connector_for(extra_config: dict[str, Any]) -> dict[str, Any]:
    """The `KVTransferConfig` fields that load the connector `extra_config` is for:
    tierkv's own for its spec (it recomputes failed loads), vLLM's otherwise."""
    if extra_config.get("spec_name") == "TierkvOffloadingSpec":
        return {"kv_connector": "TierkvConnector",
                "kv_connector_module_path": "tierkv.vllm.connector",
                "kv_load_failure_policy": "recompute"}
    return {"kv_connector": "OffloadingConnector"}


def vllm_config(shape: EngineShape, extra_config: dict[str, Any]) -> VllmConfig:
    model = ModelConfig(model=str(model_dir()), skip_tokenizer_init=True, dtype="float32",
                        seed=0, max_model_len=shape.max_model_len)
    scheduler = SchedulerConfig(max_num_seqs=shape.max_num_seqs,
                                max_num_batched_tokens=shape.max_batched_tokens,
                                max_model_len=shape.max_model_len,
                                enable_chunked_prefill=True, is_encoder_decoder=False)
    cache = CacheConfig(block_size=shape.block_size, gpu_memory_utilization=0.9,
                        cache_dtype="auto", enable_prefix_caching=True)
    transfer = KVTransferConfig(kv_role="kv_both", kv_connector_extra_config=dict(extra_config),
                                **connector_for(extra_config))
    return VllmConfig(scheduler_config=scheduler, model_config=model, cache_config=cache,
                      kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))


def _jobs_done(meta: Any) -> tuple[set[str], OffloadingWorkerMetadata | None]:
    """Every job of the step's metadata, reported done (`Engine.copy` False)."""
    done = OffloadingWorkerMetadata()
    recving = set()
    for job_id, job in meta.load_jobs.items():
        done.mark_completed(job_id)
        if not job.sync:
            recving.add(job.req_id)
    for job_id in meta.store_jobs:
        done.mark_completed(job_id)
    return recving, (done if done.completed_jobs else None)


def block_bytes(block_hash: bytes, size: int) -> np.ndarray:
    """What a block of this hash holds in one layer: derived, so any copy is checkable."""
    seed = hashlib.blake2b(block_hash, digest_size=32).digest()
    return np.frombuffer(np.random.default_rng(
        int.from_bytes(seed[:8], "little")).bytes(size), dtype=np.uint8)


#: Bound on every wait of the stand-in model's thread and of its shutdown.
MODEL_WAIT_S = 60.0
#: `Engine.run`'s pause after a step that scheduled nothing.
IDLE_STEP_S = 0.001

_Check = tuple[str, int, int, int, bytes]  # req_id, group, block index, GPU block, hash
_Write = tuple[int, int, bytes]  # group, GPU block, hash


@dataclass
class Forward:
    """One launched forward pass: the blocks it checks, the blocks it writes, and
    the blocks it checks that a request before it in the same step writes (checked
    once written). `gate` holds it half-way through its writes; `done` is its fence."""

    checks: list[_Check]
    writes: list[_Write]
    late_checks: list[_Check]
    gate: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class StandInModel:
    """Forward passes run in launch order on one thread of their own (a GPU stream's
    analogue). `run_forward` does one; the launching thread goes on at once."""

    def __init__(self, run_forward: Callable[[Forward], None], name: str) -> None:
        self._run_forward = run_forward
        self._queue: queue.Queue[Forward | None] = queue.Queue()
        self._launched: list[Forward] = []  # not yet done, in launch order
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._loop, name=f"{name}-model", daemon=True)
        self._thread.start()

    def launch(self, forward: Forward) -> None:
        self._launched = [f for f in self._launched if not f.done.is_set()]
        self._launched.append(forward)
        self._queue.put(forward)

    def fence(self) -> threading.Event | None:
        """The newest forward pass's end if it has not ended (forward passes end in
        launch order, so it covers every write launched so far), else None."""
        newest = self._launched[-1] if self._launched else None
        return newest.done if newest is not None and not newest.done.is_set() else None

    def release(self, keep: Forward | None = None) -> None:
        """Let the forward passes finish their writes (all but `keep`)."""
        for forward in self._launched:
            if forward is not keep:
                forward.gate.set()

    def close(self) -> None:
        """Finish every forward pass launched, then stop the thread (bounded)."""
        self.release()
        self._queue.put(None)
        self._thread.join(MODEL_WAIT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"the stand-in model did not finish within {MODEL_WAIT_S}s")

    def _loop(self) -> None:
        while (forward := self._queue.get()) is not None:
            try:
                self._run_forward(forward)
            except Exception as e:  # reported by the test, never a hang
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                forward.done.set()


def connector_output(worker: Any, results: Any) -> KVConnectorOutput:
    """What vLLM's model runner hands its scheduler of a step's transfers (the
    worker's `get_transfer_results`, its load errors and metadata); the worker's
    step metadata is cleared."""
    output = KVConnectorOutput(
        finished_sending=results.finished_sending or None,
        finished_recving=results.finished_recving or None,
        failed_recving=results.failed_recving,
        invalid_block_ids=worker.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    return output


@dataclass
class Engine:
    """One vLLM engine: scheduler, worker-side connector, KV tensors, stand-in model."""

    shape: EngineShape
    extra_config: dict[str, Any]
    # False: no worker side and no KV tensors; the step's jobs are reported done at
    # once (the scheduler side alone, e.g. to time it; vLLM's own CPU back end has
    # no worker on a machine without a GPU).
    copy: bool = True
    name: str = "engine"
    # False: the copies are not ordered after the model (a negative control): each
    # step's copies are waited for before the model finishes its writes.
    order_copies: bool = True
    scheduler: Scheduler = field(init=False)
    worker: Any = field(init=False)  # the worker-side connector
    kv: dict[str, torch.Tensor] = field(init=False)
    mismatches: list[str] = field(default_factory=list)
    finished: dict[str, list[int]] = field(default_factory=dict)
    steps: int = 0
    idle: bool = False  # the last step scheduled nothing
    # The scheduler's part of each step: schedule() + update_from_output().
    step_seconds: list[float] = field(default_factory=list)
    tokens: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        global _none_hash_ready
        if not _none_hash_ready:
            init_none_hash(sha256)
            _none_hash_ready = True
        self.config = vllm_config(self.shape, self.extra_config)
        kv_config = kv_cache_config(self.shape)
        self.config.cache_config.num_gpu_blocks = self.shape.gpu_blocks
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(
                                       self.config),
                                   block_size=self.shape.block_size, log_stats=True)
        self.worker = None
        self.kv = {}
        self._model: StandInModel | None = None
        if self.copy:
            self.worker = KVConnectorFactory.create_connector(self.config,
                                                              KVConnectorRole.WORKER, kv_config)
            s = self.shape
            backing = torch.zeros(s.layers, s.gpu_blocks, 2, s.block_size, s.kv_heads,
                                  s.head_dim)
            self.kv = {f"model.layers.{i}.self_attn.attn": backing[i]
                       for i in range(s.layers)}
            self.worker.register_kv_caches(self.kv)
            self._model = StandInModel(self._run_forward, self.name)
            self._copier().order_after(self._order)
        # Per KV-cache group: the KV tensors of its layers.
        self._group_layers = [[self.kv[n] for n in g.layer_names] if self.kv else []
                              for g in kv_config.kv_cache_groups]
        self._hasher = get_request_block_hasher(self.shape.block_size, sha256)
        self._counter = 0

    # -- requests ------------------------------------------------------------------------

    def add(self, prompt: Sequence[int], max_tokens: int = 4, req_id: str | None = None) -> str:
        self._counter += 1
        req_id = req_id or f"{self.name}-{self._counter}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        self.scheduler.add_request(Request(req_id, list(prompt), params, None,
                                           block_hasher=self._hasher))
        return req_id

    def run(self, timeout_s: float = 120.0) -> None:
        """Step until every request finished (bounded)."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.has_requests() or self.scheduler.has_finished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: requests still running after {timeout_s}s")
            self.step()
            if self.idle:
                # Nothing to compute (requests wait for their loads): a real engine
                # waits here too. Stepping on at once starves the model's thread of
                # the GIL (each of its numpy calls waits a switch interval for it), and
                # so the loads ordered after its writes: a minute instead of a second.
                time.sleep(IDLE_STEP_S)
        if self._model is not None:
            self._model.release()
        for _ in range(3):  # let the last stores finish and their commits reach the node
            self.step()

    # -- one engine step -----------------------------------------------------------------

    def step(self) -> None:
        start = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter() - start
        self.idle = not out.total_num_scheduled_tokens
        self.tokens["preemptions"] += len(out.preempted_req_ids or ())
        if self.worker is not None:
            connector_output = self._work(out)
        else:
            recving, worker_meta = _jobs_done(out.kv_connector_metadata)
            connector_output = KVConnectorOutput(finished_recving=recving or None,
                                                 kv_connector_worker_meta=worker_meta)
        req_ids = [r.req_id for r in out.scheduled_new_reqs] + list(
            out.scheduled_cached_reqs.req_ids)
        req_ids = [r for r in req_ids if out.num_scheduled_tokens.get(r)]
        sampled = [[self._token(r)] if self._samples(r, out) else [] for r in req_ids]
        output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=connector_output)
        start = time.perf_counter()
        updates = self.scheduler.update_from_output(out, output)
        self.step_seconds.append(scheduled + time.perf_counter() - start)
        for outputs in updates.values():
            self._count(outputs.scheduler_stats)
        self.steps += 1

    def _count(self, stats: Any) -> None:
        """Add up vLLM's own prefix-cache counters (tokens): its GPU prefix cache, and
        what the connector (the offloading back end) served."""
        if stats is None:
            return
        for name, s in (("gpu", stats.prefix_cache_stats),
                        ("external", stats.connector_prefix_cache_stats)):
            if s is None:
                continue
            self.tokens[f"{name}_queries"] += s.queries
            self.tokens[f"{name}_hits"] += s.hits

    def _work(self, out: Any) -> KVConnectorOutput:
        """The worker side of a step, in the order vLLM 0.33's model runner takes it:
        the stores deferred from the last step are submitted first, sync loads before
        the forward pass, async loads after it, then what finished and what failed."""
        worker, model = self.worker, self._model
        assert worker is not None and model is not None
        meta = out.kv_connector_metadata
        if meta.jobs_to_flush or out.has_sync_kv_loads:
            # vLLM waits for these copies before the forward pass: a model held
            # until later would never let them (ordered after it) finish.
            model.release()
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)
        launched = self._forward(out)
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        # This step's transfers reached the copy engines while the forward passes
        # launched before still wrote; they may finish now (this step's, whose
        # blocks are stored next step, is held until then).
        if not self.order_copies:
            copier = self._copier()
            copier.wait(copier.in_flight())  # the race, every time
        model.release(keep=launched)
        return connector_output(worker, results)

    def _samples(self, req_id: str, out: Any) -> bool:
        """A request samples a token once its prompt is computed by this step."""
        req = self.scheduler.requests.get(req_id)
        if req is None:
            return False
        return req.num_computed_tokens >= req.num_prompt_tokens

    def _token(self, req_id: str) -> int:
        req = self.scheduler.requests[req_id]
        return 3 + zlib.crc32(f"{req_id}:{req.num_tokens}".encode()) % 30000

    def _copier(self) -> Any:
        """tierkv's `TierkvOffloadingWorker` inside vLLM's worker-side connector."""
        assert self.worker is not None
        return self.worker.connector_worker.worker

    def _order(self) -> threading.Event | None:
        """tierkv's CPU ordering point (`HostOrder`), asked as copies are submitted:
        the fence of the model's writes launched so far."""
        assert self._model is not None
        fence = self._model.fence()
        if fence is not None:
            self.tokens["copies_submitted_mid_forward"] += 1
        return fence if self.order_copies else None

    def _forward(self, out: Any) -> Forward | None:
        """Launch the step's forward pass: check what each scheduled request counts
        as computed, then compute its new full blocks (write their bytes), group by
        group; null blocks (outside a sliding window) hold nothing. What to do is
        read from the scheduler here; the model's thread does it."""
        checks: list[_Check] = []
        late: list[_Check] = []
        writes: list[_Write] = []
        written: set[tuple[int, int]] = set()
        bs = self.shape.block_size
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(req_id)
            if req is None or n == 0:
                continue
            # The scheduler already counts this step's tokens as computed.
            before = req.num_computed_tokens - n
            first_new = before // bs
            end = min((before + n) // bs, len(req.block_hashes))
            groups = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for group, block_ids in enumerate(groups):
                for i in range(min(first_new, len(req.block_hashes), len(block_ids))):
                    if block_ids[i]:
                        (late if (group, block_ids[i]) in written else checks).append(
                            (req_id, group, i, block_ids[i], req.block_hashes[i]))
                for i in range(first_new, min(end, len(block_ids))):
                    if block_ids[i]:
                        writes.append((group, block_ids[i], req.block_hashes[i]))
                        written.add((group, block_ids[i]))
        if not (checks or writes) or self._model is None:
            return None
        forward = Forward(checks, writes, late)
        self._model.launch(forward)
        return forward

    def _run_forward(self, forward: Forward) -> None:
        """On the model's thread: the checks, the first half of every new block, a
        wait until the engine submitted its next transfers (bounded), the rest."""
        for check in forward.checks:
            self._check(*check)
        half = self.shape.layer_page_bytes // 2
        for group, block_id, block_hash in forward.writes:
            self._write(group, block_id, block_hash, slice(0, half))
        if forward.writes and not forward.gate.wait(MODEL_WAIT_S):
            self.mismatches.append(f"{self.name}: a forward pass was held {MODEL_WAIT_S}s")
        for group, block_id, block_hash in forward.writes:
            self._write(group, block_id, block_hash, slice(half, None))
        for check in forward.late_checks:
            self._check(*check)

    def _pages(self, group: int, block_id: int) -> list[np.ndarray]:
        return [t[block_id].view(torch.uint8).view(-1).numpy()
                for t in self._group_layers[group]]

    def _write(self, group: int, block_id: int, block_hash: bytes, part: slice) -> None:
        page = self.shape.layer_page_bytes
        for layer, view in enumerate(self._pages(group, block_id)):
            view[part] = block_bytes(block_hash + bytes([group, layer]), page)[part]

    def _check(self, req_id: str, group: int, index: int, block_id: int,
               block_hash: bytes) -> None:
        page = self.shape.layer_page_bytes
        for layer, view in enumerate(self._pages(group, block_id)):
            if not np.array_equal(view, block_bytes(block_hash + bytes([group, layer]), page)):
                self.mismatches.append(f"{req_id}: group {group} block {index} (GPU block "
                                       f"{block_id}, layer {layer}) does not hold its bytes")
                return

    # -- what a test does to it --------------------------------------------------------

    def reset(self) -> None:
        """vLLM's weight-update path (`pause(clear_cache)`): every request preempted,
        the prefix caches reset, the offloading connector's too."""
        if not self.scheduler.reset_prefix_cache(reset_running_requests=True,
                                                 reset_connector=True):
            raise RuntimeError(f"{self.name}: vLLM did not reset its prefix cache")

    def abort(self, req_ids: Sequence[str]) -> None:
        """The client went away: vLLM aborts the requests wherever they are."""
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def fail_copies(self, direction: str, count: int) -> None:
        """Make tierkv's worker fail the next `count` copies of `direction` ("load" or
        "store") as a copy it cannot do fails: the job's spec names more chunks than
        its GPU blocks fill (fault injection, through the real failure path)."""
        from tierkv.vllm.jobs import TierkvLoadStoreSpec

        assert self.worker is not None
        worker = self.worker.connector_worker.worker
        submit = getattr(worker, f"submit_{direction}")
        left = [count]

        def failing(job_id: int, src: Any, dst: Any, *args: Any) -> bool:
            if left[0] > 0:
                left[0] -= 1
                spec = src if direction == "load" else dst
                broken = TierkvLoadStoreSpec([n + 1 for n in spec.chunks_per_group],
                                             spec.rows.tolist(), spec.region)
                src, dst = (broken, dst) if direction == "load" else (src, broken)
                self.tokens[f"failed_{direction}s"] += 1
            return submit(job_id, src, dst, *args)

        setattr(worker, f"submit_{direction}", failing)

    # -- results -------------------------------------------------------------------------

    def close(self) -> None:
        if self._model is not None:
            self._model.close()
            self.mismatches += self._model.errors
        if self.worker is not None:
            self.worker.shutdown()
        connector = self.scheduler.connector
        if connector is not None:
            connector.shutdown()
