"""LMCache 0.5.6 multi-process mode as vLLM's scheduler sees it: the scheduler step
of `tierkv bench vllm`, with vLLM's `LMCacheMPConnector` in front of an LMCache
cache server process.

    <peers' venv>/bin/python -m tierkv.bench.peers.drivers.lmcache_step \\
        --workload '{"requests": 256, "steps": 300, ...}' [--repeats 3]

Runs in the peers' environment (never in tierkv's); prints one JSON line on stdout:
per repeat the median step seconds, the prompt tokens the offloading tier served
while timed (`offloaded_hit_tokens`, vLLM's own counter) and the prompt tokens of
the requests admitted while timed (`admitted_tokens`). Everything else (LMCache's
logs, the server's) goes to stderr.

How LMCache MP is started and driven:

* The cache server is LMCache's own entry point, `python -m
  lmcache.v1.multiprocess.server` (what `lmcache server` runs, without its HTTP
  front end), started per repeat as a child process on a free port of 127.0.0.1
  with an L1 (CPU) cache of the same bytes as the other back ends' CPU tier, LRU
  eviction, LMCache's default chunk of 256 tokens, observability off (no metrics
  port). The driver waits until the port accepts a connection (or the child dies),
  and ends it by pid (SIGTERM, then SIGKILL); anything new it left in /dev/shm is
  removed and reported.
* vLLM's scheduler is the harness's (`tierkv.bench.vllm_engine.Engine`, scheduler
  side, `copy=False`) with `LMCacheMPConnector` (vLLM's name, which loads the
  lmcache package's connector) as its KV connector. The harness picks
  `OffloadingConnector` for every config but tierkv's, so this process wraps its
  `connector_for` to name LMCache's connector for a config that names an
  `lmcache.mp.port`.
* LMCache needs a worker side: its server only finds what a worker stored, and a
  request that LMCache loads (or that finished) waits until the worker reports the
  load (the store) done. So `LMCacheStepEngine` adds vLLM's worker-side
  `LMCacheMPConnector` with CPU KV tensors of the harness's geometry (registered
  with the server, which copies through them), and runs it each step between
  `schedule()` and `update_from_output()` as vLLM's model runner does (stores and
  loads submitted, then what finished). It waits until the server has finished
  every transfer it submitted before it asks what finished: the transfers are done
  at once from the scheduler's view, as the harness reports them for the other back
  ends. Only the scheduler calls are timed, as for the others; the lookups the
  connector sends to the server and polls for are in them.
* Its server answers the first lookups only seconds after they are sent, longer
  than the harness's whole run of steps lasts while nothing is admitted (a few ms
  each), so the first step lasts until LMCache admits a request (at most
  `ADMISSION_TIMEOUT_S`), untimed, pausing so that the server has the cores.
  A repeat that still admits nothing while timed is run once more, then reported
  as it is (its admitted tokens 0: a step that did no work).

`tierkv` is on the path here only for the harness: its node modules (tierkv's own
back end, which needs msgpack) are replaced by empty stand-ins before the harness
is imported; nothing here uses them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

# The harness imports tierkv's node (config, supervisor) for tierkv's own back end;
# it needs packages this environment does not hold, and this driver never uses it.
for _name, _attrs in (("tierkv.node.config", ("Config", "config_from_dict")),
                      ("tierkv.node.supervisor", ("Node",))):
    if _name not in sys.modules:
        _stub = types.ModuleType(_name)
        for _attr in _attrs:
            setattr(_stub, _attr, None)
        sys.modules[_name] = _stub

from tierkv.bench import vllm_engine  # noqa: E402
from tierkv.bench.vllm import Workload, step_times  # noqa: E402
from tierkv.bench.vllm_engine import (  # noqa: E402
    Engine,
    EngineShape,
    connector_output,
    kv_cache_config,
)

HOST = "127.0.0.1"
CHUNK_TOKENS = 256  # LMCache's default chunk
SERVER_START_TIMEOUT_S = 180.0  # importing LMCache's server takes ~5-10 s on an idle core
SERVER_STOP_TIMEOUT_S = 15.0
TRANSFER_TIMEOUT_S = 60.0  # one step's stores and loads on the server
ADMISSION_TIMEOUT_S = 120.0  # for the first request LMCache admits (see `step`)
RERUNS = 1  # a repeat that admitted nothing while timed is run again this many times
SHM = Path("/dev/shm")

_connector_for = vllm_engine.connector_for


def connector_for(extra_config: dict[str, Any]) -> dict[str, Any]:
    """The harness's choice, except LMCache's connector for an LMCache MP config."""
    if "lmcache.mp.port" in extra_config:
        return {"kv_connector": "LMCacheMPConnector"}
    return _connector_for(extra_config)


vllm_engine.connector_for = connector_for


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


@contextmanager
def cache_server(l1_bytes: int) -> Iterator[int]:
    """An LMCache MP cache server on a free loopback port (yielded); ended by pid."""
    port = free_port()
    before = _shm_names()
    cmd = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", HOST,
           "--port", str(port), "--chunk-size", str(CHUNK_TOKENS),
           "--l1-size-gb", f"{l1_bytes / 2**30:.6f}", "--eviction-policy", "LRU",
           # CPU tensors: the engine-driven path (the worker copies); 'auto' lets
           # the connector pick it, as it does on a machine without CUDA.
           "--supported-transfer-mode", "auto", "--disable-observability"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                            stderr=sys.stderr)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _accepts(port):
            if proc.poll() is not None:
                raise RuntimeError(f"the LMCache MP server exited with status "
                                   f"{proc.returncode} at startup (its log is above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the LMCache MP server did not listen on {HOST}:{port} "
                                   f"within SERVER_START_TIMEOUT_S={SERVER_START_TIMEOUT_S}s")
            time.sleep(0.2)
        yield port
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(SERVER_STOP_TIMEOUT_S)
        for name in sorted(_shm_names() - before):
            if "lmcache" in name.lower():  # others' segments are not ours to touch
                print(f"[lmcache_step] removing /dev/shm/{name} the server left",
                      file=sys.stderr)
                (SHM / name).unlink(missing_ok=True)


def lmcache_extra(port: int) -> dict[str, Any]:
    return {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": port,
            "lmcache.mp.mq_timeout": 60.0}


class LMCacheStepEngine(Engine):
    """The harness's scheduler-only engine plus LMCache's worker side (see the
    module docstring): CPU KV tensors registered with the server, each step's
    stores and loads submitted and waited for, then reported."""

    _admitted = False  # once LMCache admitted a request (see `step`)

    def __post_init__(self) -> None:
        super().__post_init__()  # copy=False: the scheduler side alone
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        s = self.shape
        # vLLM's engine core resolves the layout before the workers start; the
        # harness's tensors are vLLM's per-layer (blocks, 2, tokens, heads, dim).
        self.config.cache_config.kv_cache_layout = "LBNHC"
        with set_current_vllm_config(self.config):
            self.worker = KVConnectorFactory.create_connector(
                self.config, KVConnectorRole.WORKER, kv_cache_config(s))
            backing = torch.zeros(s.layers, s.gpu_blocks, 2, s.block_size, s.kv_heads,
                                  s.head_dim)
            self.kv = {f"model.layers.{i}.self_attn.attn": backing[i]
                       for i in range(s.layers)}
            self.worker.register_kv_caches(self.kv)

    def step(self) -> Any:
        """The harness's step; the first one lasts until LMCache admits a request
        (or ADMISSION_TIMEOUT_S): its server answers the first lookups only after
        seconds, longer than the whole warm-up of empty steps takes, so the timed
        steps would otherwise be empty ones. Not timed (the harness times the last
        step only), and with pauses that leave its server the cores."""
        result = super().step()
        deadline = time.monotonic() + ADMISSION_TIMEOUT_S
        while not self._admitted and time.monotonic() < deadline:
            self._admitted = bool(self.scheduler.running)
            if not self._admitted:
                time.sleep(0.005)
                result = super().step()
        self._admitted = True
        return result

    def _work(self, out: Any) -> Any:
        """vLLM's model runner's connector calls, the forward pass left out."""
        worker = self.worker
        meta = out.kv_connector_metadata
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        self._wait_transfers()
        return connector_output(worker, worker.get_transfer_results(out.finished_req_ids))

    # Per engine closed: whether the scheduler's and the worker's adapters still
    # thought the server healthy (a degraded adapter drops lookups and stores).
    health: list[tuple[bool, bool]] = []
    # ... and the requests' states, and the connector's trackers' states, then.
    states: list[tuple[dict[str, int], dict[str, int]]] = []

    def close(self) -> None:
        """The scheduler's connector first: a lookup it still has in flight is
        answered while the worker's KV caches are still registered."""
        connector = self.scheduler.connector
        adapter = getattr(connector, "scheduler_adapter", None)
        LMCacheStepEngine.health.append(
            (bool(adapter is not None and adapter.is_healthy),
             bool(self.worker is not None and self.worker.worker_adapter.is_healthy)))
        from collections import Counter

        LMCacheStepEngine.states.append(
            (dict(Counter(r.status.name for r in self.scheduler.requests.values())),
             dict(Counter(t.state.name for t in getattr(connector, "request_trackers",
                                                        {}).values()))))
        if connector is not None:
            connector.shutdown()
        if self.worker is not None:
            self.worker.shutdown()

    def _wait_transfers(self) -> None:
        """Until the server finished every store and load submitted so far (its
        futures, which the adapter polls in `get_finished`)."""
        adapter = self.worker.worker_adapter
        deadline = time.monotonic() + TRANSFER_TIMEOUT_S
        while not (all(f.query() for f in list(adapter.store_futures.values()))
                   and all(f.query() for f, _ in list(adapter.retrieve_futures.values()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"LMCache's transfers did not finish within "
                                   f"TRANSFER_TIMEOUT_S={TRANSFER_TIMEOUT_S}s")
            time.sleep(0.0002)


def measure(workload: Workload, repeats: int) -> dict[str, Any]:
    l1_bytes = workload.cpu_blocks * EngineShape().page_size
    out: dict[str, Any] = {"median_step_s": [], "offloaded_hit_tokens": [],
                           "admitted_tokens": []}
    out["reruns"] = 0
    for _ in range(repeats):
        for attempt in range(1 + RERUNS):
            timed = step_times(lmcache_extra, workload, cache_server(l1_bytes),
                               make_engine=LMCacheStepEngine)
            if timed.admitted_tokens:
                break
            # No request admitted while timed: the steps timed were empty. Run the
            # repeat again once (a loaded machine), then report it as it was.
            scheduler_ok, worker_ok = LMCacheStepEngine.health[-1]
            print(f"[lmcache_step] no request admitted while timed (attempt {attempt + 1}; "
                  f"adapters healthy: scheduler {scheduler_ok}, worker {worker_ok}; requests, "
                  f"trackers at the end: {LMCacheStepEngine.states[-1]})",
                  file=sys.stderr, flush=True)
            out["reruns"] += 1
        else:
            print(f"[lmcache_step] reported as measured: no request admitted in "
                  f"{workload.steps} timed steps, {1 + RERUNS} times", file=sys.stderr,
                  flush=True)
        out["median_step_s"].append(statistics.median(timed.seconds))
        out["offloaded_hit_tokens"].append(timed.offloaded_hit_tokens)
        out["admitted_tokens"].append(timed.admitted_tokens)
    return out


def versions() -> dict[str, str]:
    import importlib.metadata as m

    return {p: m.version(p) for p in ("lmcache", "vllm", "torch")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.peers.drivers.lmcache_step",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="{}",
                        help="the Workload's fields as JSON (default: its defaults)")
    parser.add_argument("--tierkv-hits", action="store_true",
                        help="the workload's tierkv_hits() variant")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    workload = Workload(**json.loads(args.workload))
    if args.tierkv_hits:
        workload = workload.tierkv_hits()
    protocol = sys.stdout
    with redirect_stdout(sys.stderr):  # LMCache prints; stdout carries the answer
        result = measure(workload, args.repeats)
    protocol.write(json.dumps({"system": "lmcache-mp", "versions": versions(),
                               "workload": vars(workload), "repeats": args.repeats,
                               **result}) + "\n")
    protocol.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
