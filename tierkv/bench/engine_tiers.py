"""`tierkv bench engine`'s tier cases: a fresh engine after a node restart, its
blocks only in a lower tier, against an engine without offloading.

What a user sees the first minutes after a node restarts: the blocks of the shared
documents live only in disk or S3, and a fresh engine asks for them. tierkv loads
a block from a tier only when it is expected sooner than recomputing it
(`tierkv.core.costs`), so no case may be much slower than offloading nothing, even
behind a slow link. Each case:

* a node with a CPU tier and the case's lower tier;
* the workload (`documents`: questions about shared documents, every request at
  once) served once by a tierkv engine, to store it; the node then restarted, so
  that the blocks live only in the lower tier (the CPU case keeps them in the CPU
  tier, no restart);
* a fresh tierkv engine serves the workload again: its median TTFT against the
  same workload on the engine without offloading (`none`, its own cache emptied),
  run right after it; output token for token the same.

The cases share one store: a node with the CPU tier, a disk tier and an S3 tier
(a local moto endpoint, `tierkv.node.s3server`, in a process of its own, so it
outlives the node's restarts) stores the workload once; each case restarts it with
its one lower tier. The slow links are `tierkv.bench.delay_proxy` in front of the
same endpoint (a fixed delay per request).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.bench.common import Part, Row, Stat
from tierkv.bench.delay_proxy import DelayProxy
from tierkv.demo.vllm_process import EngineConfig, EngineProcess, tierkv_transfer
from tierkv.demo.vllm_workload import Round, documents

TIER_BLOCKS = 512  # the node's CPU tier
DEVICE_BLOCKS = 160  # vLLM's own cache
RATIO_GOAL = 1.3  # a case's median TTFT at most this many times no offloading's
CASCADE_S = 120.0  # for the lower tiers to hold what the store pass stored
ENGINE_START_S = 300.0
RUN_S = 600.0
STATS_TIERS = ("disk", "s3")


@dataclass(frozen=True)
class TierCase:
    """Where the blocks are when the fresh engine asks: `tier` (cpu, disk, s3) and,
    for S3, the delay the link adds to each request (None: the endpoint itself)."""

    name: str
    tier: str
    delay_s: float | None = None

    @property
    def restarts(self) -> bool:
        return self.tier != "cpu"


CASES = (TierCase("CPU tier", "cpu"), TierCase("disk", "disk"),
         TierCase("S3, local endpoint", "s3"),
         TierCase("S3, +0.2 s a request", "s3", 0.2),
         TierCase("S3, +1.5 s a request", "s3", 1.5))
QUICK_CASES = (CASES[0], CASES[1], CASES[2], CASES[4])


def workload(quick: bool, seed: int = 21) -> list[Round]:
    """4 shared documents, 6 questions each: 24 prompts, all arriving at once (the
    burst right after a restart: every request wants the tier at the same time).
    Another `seed` gives other documents of the same shape (a warm-up)."""
    rounds = documents(4, 8 if quick else 16, 6, seed=seed)
    return [[request for row in rounds for request in row]]


@dataclass
class CaseResult:
    case: TierCase
    ttft: list[float] = field(default_factory=list)  # per request, tierkv's fresh engine
    none_medians: list[float] = field(default_factory=list)  # right before, right after
    deferred: str = ""  # vLLM's deferred lookups
    identical: tuple[int, int] = (0, 0)
    hits: dict[str, int] = field(default_factory=dict)  # vLLM's, by source
    node: dict[str, Any] = field(default_factory=dict)  # the node's, over the run

    def share(self) -> float:
        """Median TTFT over no offloading's (the mean of its medians right before and
        right after: the machine's speed drifts)."""
        return statistics.median(self.ttft) / statistics.mean(self.none_medians)


# -- the endpoint, the link and the node ---------------------------------------------------


def s3_python() -> str:
    """A python with boto3 and moto, for the endpoint and the node's S3 tier: this
    one if it has them, else `TIERKV_MAIN_PYTHON` (scripts/_env.sh sets it beside the
    engine environment, which has neither), else the checkout's `.venv`. Raises
    SystemExit saying what to do."""
    if all(importlib.util.find_spec(m) is not None for m in ("boto3", "moto")):
        return sys.executable
    built = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
    for python in (os.environ.get("TIERKV_MAIN_PYTHON"), str(built)):
        if python and Path(python).exists():
            return python
    raise SystemExit("the S3 cases need a python with boto3 and moto: run through "
                     "scripts/test (or `scripts/setup`), or set TIERKV_MAIN_PYTHON")


@contextlib.contextmanager
def s3_endpoint() -> Iterator[tuple[str, DelayProxy]]:
    """A local S3 endpoint (its own process) and a delay proxy in front of it; the
    key pair is in this process's environment meanwhile, for the node's S3 tier
    (its processes inherit it), and never in a config file."""
    from tierkv.node.s3server import S3Server, new_keys

    keys = new_keys()
    env = {"AWS_ACCESS_KEY_ID": keys.access_key_id,
           "AWS_SECRET_ACCESS_KEY": keys.secret_access_key,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with S3Server(keys=keys, ready_timeout_s=60, python=s3_python()) as server, \
                DelayProxy(server.endpoint_url, 0.0) as proxy:
            yield server.endpoint_url, proxy
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def node_config(work: Path, page_size: int, tiers: list[dict[str, Any]]) -> Any:
    from tierkv.node.config import config_from_dict

    return config_from_dict({
        "instance": f"benchtiers{os.getpid()}", "run_dir": str(work / "tiers-run"),
        "log_level": "warning",
        "cpu": {"num_blocks": TIER_BLOCKS, "page_size": page_size, "world_size": 1},
        "supervisor": {"ready_timeout_s": 60.0},
        "worker": {"enabled": False}, "tiers": tiers}, "<tierkv bench engine, tiers>")


def disk_tier(work: Path, page_size: int) -> dict[str, Any]:
    (work / "tiers-disk").mkdir(exist_ok=True)
    return {"type": "disk", "root": str(work / "tiers-disk"),
            "budget_bytes": 4 * TIER_BLOCKS * (page_size + 4096)}


def s3_tier(endpoint_url: str, bucket: str) -> dict[str, Any]:
    # Timeouts well above the slowest link's 1.5 s, so that a slow request is slow,
    # not failed.
    return {"type": "s3", "bucket": bucket, "endpoint_url": endpoint_url,
            "create_bucket": True, "connect_timeout_s": 5.0, "read_timeout_s": 30.0,
            "exists_timeout_s": 10.0, "max_attempts": 2}


class TierNode:
    """The cases' node, restarted with another set of tiers on the same run dir."""

    def __init__(self, config: Any) -> None:
        from tierkv.node.supervisor import Node

        self.python = s3_python()
        self.node = Node(config, python=self.python)
        self.node.start()

    def restart(self, config: Any) -> None:
        from tierkv.node.supervisor import Node

        self.node.stop()
        self.node = Node(config, python=self.python)
        self.node.start()

    def stop(self) -> None:
        self.node.stop()

    def stats(self) -> dict[str, Any]:
        from tierkv.client import Client

        with Client.from_config(self.node.config) as client:
            return client.stats()

    def wait_cascaded(self, tiers: tuple[str, ...], timeout_s: float) -> dict[str, int]:
        """Until every lower tier holds the blocks the CPU tier holds; what each holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            want = int(stats["cpu"].get("blocks_ready", 0) or stats["cpu"].get("blocks", 0))
            held = {t: int(stats["tiers"].get(t, {}).get("blocks", 0)) for t in tiers}
            if all(n >= want for n in held.values()) or time.monotonic() > deadline:
                return held
            time.sleep(0.5)


# -- one case ------------------------------------------------------------------------------


def engine_config(model: str, shape: Any, block: int, node: TierNode | None) -> EngineConfig:
    transfer = None if node is None else tierkv_transfer(node.node.config_path)
    return EngineConfig(model=model, shape=shape, block_size=block, kv_blocks=DEVICE_BLOCKS,
                        max_model_len=4096, max_num_seqs=16, max_num_batched_tokens=2048,
                        kv_transfer=transfer)


def outputs(result: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for row in result["rounds"] for r in row]


def ttfts(result: dict[str, Any]) -> list[float]:
    return [r["ttft_s"] for row in result["rounds"] for r in row]


def cost_line(cost: dict[str, Any]) -> str:
    """A tier's cost line as the node has learned it."""
    if not cost:
        return "-"
    return (f"{cost.get('latency_ms', 0):.1f} ms + {cost.get('bandwidth_mb_s', 0):.0f} MB/s "
            f"({cost.get('samples', 0)} samples)")


def node_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the node did over a run: blocks promoted, and left to recompute, per
    lower tier; its cost line for each; the rule's counters."""
    out: dict[str, Any] = {}
    for name, tier in after.get("tiers", {}).items():
        was = before.get("tiers", {}).get(name, {})
        out[name] = {
            "promoted": tier.get("promoted_blocks", 0) - was.get("promoted_blocks", 0),
            "slower_than_recompute": (tier.get("slower_than_recompute", 0)
                                      - was.get("slower_than_recompute", 0)),
            "load_cost": cost_line(tier.get("load_cost", {}))}
    tiering, was = after.get("tiering", {}), before.get("tiering", {})
    for name in ("promotions_overrun", "background_promotions"):
        out[name] = tiering.get(name, 0) - was.get(name, 0)
    out["cpu_hits"] = after["cpu"].get("hits", 0) - before["cpu"].get("hits", 0)
    return out


def vllm_hits(metrics: dict[str, float]) -> dict[str, int]:
    out = {}
    for source in ("device", "host", "disk", "external_unspecified"):
        value = metrics.get(f"vllm:prompt_tokens_cached_by_source{{source={source}}}", 0)
        if value:
            out[source] = int(value)
    out["computed"] = int(metrics.get("vllm:prompt_tokens_by_source{source=local_compute}", 0))
    return out


def deferred(metrics: dict[str, float]) -> str:
    """The lookups vLLM deferred a step (the node had not answered yet)."""
    n = int(metrics.get("vllm:kv_offload_lookup_async_delay_seconds_count", 0))
    waited = metrics.get("vllm:kv_offload_lookup_async_delay_seconds_sum", 0.0)
    return f"{n} lookups deferred" + (f" ({waited / n * 1e3:.0f} ms each)" if n else "")


class Cases:
    """Runs the cases in order on one store (see the module docstring)."""

    def __init__(self, part: Part, none: EngineProcess, model: str, shape: Any, block: int,
                 python: str, work: Path, quick: bool) -> None:
        self.part, self.none, self.work, self.quick = part, none, work, quick
        self.model, self.shape, self.block, self.python = model, shape, block, python
        self.page = shape.page_size(block)
        self.rounds = workload(quick)
        self.warm_up = workload(quick, seed=97)
        self.bucket = f"tierkv-bench-{uuid.uuid4().hex[:12]}"
        self.results: list[CaseResult] = []
        self._engines = 0

    def run(self) -> list[CaseResult]:
        cases = QUICK_CASES if self.quick else CASES
        with s3_endpoint() as (endpoint, proxy):
            store = node_config(self.work, self.page, [
                disk_tier(self.work, self.page), s3_tier(endpoint, self.bucket)])
            node = TierNode(store)
            try:
                self._store(node)
                for case in cases:
                    if self.part.over_budget(f"the tier case {case.name}"):
                        break
                    if case.restarts:
                        proxy.delay_s = case.delay_s or 0.0
                        node.restart(self._config(case, endpoint, proxy))
                    self.results.append(self._case(case, node))
            finally:
                node.stop()
        return self.results

    def _config(self, case: TierCase, endpoint: str, proxy: DelayProxy) -> Any:
        if case.tier == "disk":
            return node_config(self.work, self.page, [disk_tier(self.work, self.page)])
        url = endpoint if case.delay_s is None else proxy.endpoint_url
        return node_config(self.work, self.page, [s3_tier(url, self.bucket)])

    def _engine(self, node: TierNode, name: str) -> EngineProcess:
        self._engines += 1
        config = engine_config(self.model, self.shape, self.block, node)
        return EngineProcess(config, self.work / f"tiers-{self._engines}-{name}.log",
                             python=self.python).start(ENGINE_START_S)

    def _store(self, node: TierNode) -> None:
        """The workload once, by an engine that then goes: its blocks stay at the node
        and cascade to every lower tier."""
        engine = self._engine(node, "store")
        try:
            engine.run(self.rounds, 8, timeout_s=RUN_S)
            engine.settle(8)
        finally:
            engine.stop()
        held = node.wait_cascaded(STATS_TIERS, CASCADE_S)
        self.part.note(f"tier cases: workload of {sum(len(r) for r in self.rounds)} prompts "
                       f"over 4 documents stored once; the lower tiers hold {held} blocks")

    def _case(self, case: TierCase, node: TierNode) -> CaseResult:
        result = CaseResult(case)
        engine = self._engine(node, case.tier)
        try:
            # Other documents first: the engine without offloading has served before,
            # and an engine's first steps pay for warming up, offloading or not.
            engine.run(self.warm_up, 8, timeout_s=RUN_S)
            engine.settle(8)
            # The engine without offloading right before and right after, its own
            # cache emptied: the same prompts, the machine as it is now.
            alone = [self._alone()]
            before = node.stats()
            ours = engine.run(self.rounds, 8, timeout_s=RUN_S)
            engine.settle(8)
            after = node.stats()
        finally:
            engine.stop()
        alone.append(self._alone())
        same = sum(a == b for a, b in zip(outputs(ours), outputs(alone[0]), strict=True))
        result.ttft = ttfts(ours)
        result.none_medians = [statistics.median(ttfts(a)) for a in alone]
        result.identical = (same, len(outputs(alone[0])))
        result.hits = vllm_hits(ours["metrics"])
        result.node = node_figures(before, after)
        result.deferred = deferred(ours["metrics"])
        self.part.note(f"tier case {case.name}: {same}/{len(outputs(alone[0]))} identical to "
                       f"no offloading; vLLM's hit tokens {result.hits}; {result.deferred}; "
                       f"node {result.node}")
        return result

    def _alone(self) -> dict[str, Any]:
        return self.none.run(self.rounds, 8, reset_device_cache=True, timeout_s=RUN_S)


def rows(part: Part, results: list[CaseResult], block: int) -> None:
    """A row per case: median TTFT against no offloading's, with the goal."""
    for r in results:
        goal = "< 1.0" if r.case.tier == "cpu" else f"<= {RATIO_GOAL}"
        tier = r.case.tier
        figures = r.node.get(tier, {})
        where = (f"{figures.get('promoted', 0) * block} tokens promoted from {tier}, "
                 f"{figures.get('slower_than_recompute', 0)} blocks left to recompute, "
                 f"load cost {figures.get('load_cost', '-')}; " if tier != "cpu" else
                 f"{r.node.get('cpu_hits', 0)} CPU-tier hits; ")
        part.add(Row("engine", f"median TTFT, fresh engine, blocks in {r.case.name}",
                     Stat.of(r.ttft).scaled(1e3), "ms", "no offloading (vLLM alone)",
                     Stat.one(1.0 / r.share()),
                     Stat(statistics.mean(r.none_medians), min(r.none_medians),
                          max(r.none_medians), len(r.none_medians)).scaled(1e3), paired=False,
                     note=f"{r.share():.2f}x no offloading (goal {goal}); "
                          f"{r.identical[0]}/{r.identical[1]} identical; {where}"
                          f"vLLM's hit tokens {r.hits}"))
