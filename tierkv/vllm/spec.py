"""`TierkvOffloadingSpec`: what vLLM's offloading connector loads by name.

    --kv-transfer-config '{"kv_connector": "TierkvConnector",
      "kv_connector_module_path": "tierkv.vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "TierkvOffloadingSpec",
        "spec_module_path": "tierkv.vllm", "tierkv_config": "/etc/tierkv/node.toml"}}'

Extra config read here (`kv_connector_extra_config`):

* ``tierkv_config``: the node's config file (its broker address, instance name,
  client keys); or ``tierkv_instance`` and ``tierkv_address`` given directly.
* ``namespace``: stands in for the model's identity (name, revision, quantization)
  in the namespace; engines agreeing on it and on the KV byte layout share blocks
  (see `tierkv.vllm.identity`).
* ``budget_ms`` (20.0): how long vLLM's scheduler thread may wait for the broker in
  one step, all calls together; past it, lookups answer RETRY (asked again next
  step) and stores are offered again next step.
* ``timeout_s`` (2.0): a round trip with no reply in this long means the broker is
  gone: no hits and no stores for ``retry_s`` (5.0).
* ``sync_lookups`` (2): requests a step may look up in a round trip of their own
  (within the budget); the others are answered at the next step.
* ``max_lookup_keys`` (2048): chunks of one request in one such round trip.
* ``lookup_wait_ms`` (250): how long a request may be told RETRY for want of the
  broker's answer; then its lookups miss (vLLM computes) until the answer comes.
* ``pending_wait_ms`` (5000): how long a request may wait for blocks another
  engine is writing or a tier is promoting; then they miss (vLLM computes).
* ``allow_unpinned`` (false): let the worker copy from a CPU tier it could not pin
  for DMA (synchronous copies, several times slower) rather than stop at start.
* ``prefill_tokens_per_s`` (measured): this engine's prefill rate, which a
  promotion from a secondary tier must beat to be waited for (`tierkv.vllm.prefill`);
  a number fixes it, 0 turns the rule off (every promotion is waited for).
* ``block_size``: vLLM's own (tokens per offloaded chunk).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from tierkv.client import PING_S, Client, ping_interval
from tierkv.core.shm import SharedRegion
from tierkv.node.config import load_config, tier_name
from tierkv.node.realtime import check_priority
from tierkv.vllm.identity import EngineIdentity, current_vllm_facts
from tierkv.vllm.layout import check_node
from tierkv.vllm.manager import ManagerOptions, Metrics, TierkvOffloadingManager
from tierkv.vllm.prefill import PrefillRate
from tierkv.vllm.request_keys import require_request_keys

SPARE_ROWS = ManagerOptions().spare_rows
PREFETCH_REQUESTS = ManagerOptions().prefetch_requests
SPARE_SHARE = 8  # spare rows: at most this fraction of the node's CPU rows (1/8)
CONNECTOR_HINT = ('"kv_connector": "TierkvConnector", "kv_connector_module_path": '
                  '"tierkv.vllm.connector"')


class TierkvOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        def counter(doc: str) -> OffloadingCounterMetadata:
            return OffloadingCounterMetadata(documentation=doc)

        return {
            Metrics.LOOKUP_KEYS: counter("Chunks looked up in the tierkv node."),
            Metrics.HIT_KEYS: counter("Chunks the tierkv node had ready in its CPU tier."),
            Metrics.STORED_BLOCKS: counter("Blocks the tierkv node reserved for stores."),
            Metrics.REFUSED_BLOCKS: counter(
                "Blocks not reserved for a store: no room in the CPU tier now."),
            Metrics.DROPPED_BLOCKS: counter(
                "Blocks never stored: their request ended before its store found rows."),
            Metrics.ROUND_TRIPS: counter("Round trips to the tierkv broker."),
            Metrics.BROKER_FAILURES: counter(
                "Round trips the tierkv broker did not answer in time, or refused."),
            Metrics.OVER_BUDGET: counter(
                "Scheduler calls that went on without the broker: the step's budget_ms "
                "was spent."),
            Metrics.ROUND_TRIP_SECONDS: OffloadingHistogramMetadata(
                documentation="Seconds of one round trip to the tierkv broker.",
                buckets=(1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0)),
        }

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        _say_what_this_vllm_lacks()
        extra = self.extra_config
        if config.canonical_layout:
            raise ValueError("tierkv keeps each rank's own block layout: remove "
                             "'canonical_layout' from kv_connector_extra_config")
        if "tierkv_config" in extra:
            node = load_config(extra["tierkv_config"])
            self.instance = node.instance
            self.address = node.connect_address("client")
            self.curve = node.client.curve_keys()
            self.tiers = [(tier_name(t), str(t.get("type", ""))) for t in node.tiers]
            realtime = node.client.realtime_priority
            self.ping_s = ping_interval(node.broker.owner_timeout_s)
        elif "tierkv_instance" in extra and "tierkv_address" in extra:
            self.instance = str(extra["tierkv_instance"])
            self.address = str(extra["tierkv_address"])
            self.curve = None
            self.tiers = []
            realtime = 0
            self.ping_s = PING_S  # shortened once the broker says its owner timeout
        else:
            raise ValueError("kv_connector_extra_config needs 'tierkv_config' (the tierkv "
                             "node's config file) or 'tierkv_instance' and 'tierkv_address'")
        self.timeout_s = _option(extra, "timeout_s", 2.0)
        self.prefill_tps: float | None = None  # measured
        if extra.get("prefill_tokens_per_s") is not None:
            self.prefill_tps = _option(extra, "prefill_tokens_per_s", 0.0)
            if not 0 <= self.prefill_tps < float("inf"):
                raise ValueError(f"kv_connector_extra_config: prefill_tokens_per_s must be "
                                 f"a number >= 0, got {self.prefill_tps}")
        # The scheduler thread is lifted into SCHED_RR only while it waits for the broker.
        self.realtime_priority = int(_option(extra, "realtime_priority", realtime))
        why = check_priority(self.realtime_priority)
        if why is not None:
            raise ValueError(f"kv_connector_extra_config: realtime_priority {why}")
        self.options = ManagerOptions(
            budget_ms=_option(extra, "budget_ms", 20.0),
            retry_s=_option(extra, "retry_s", 5.0),
            sync_lookups=int(_option(extra, "sync_lookups", 2)),
            max_lookup_keys=int(_option(extra, "max_lookup_keys", 2048)),
            lookup_wait_ms=_option(extra, "lookup_wait_ms", 250.0),
            pending_wait_ms=_option(extra, "pending_wait_ms", 5000.0),
            spare_rows=int(_option(extra, "spare_rows", SPARE_ROWS)),
            prefetch_requests=int(_option(extra, "prefetch_requests", PREFETCH_REQUESTS)))
        o = self.options
        if (self.timeout_s <= 0 or min(o.budget_ms, o.retry_s, o.sync_lookups,
                                       o.lookup_wait_ms, o.pending_wait_ms, o.spare_rows,
                                       o.prefetch_requests) < 0
                or o.max_lookup_keys < 1):
            raise ValueError(
                f"kv_connector_extra_config: timeout_s must be > 0, budget_ms, retry_s, "
                f"sync_lookups, lookup_wait_ms, pending_wait_ms, spare_rows and "
                f"prefetch_requests >= 0, max_lookup_keys >= 1; "
                f"got timeout_s={self.timeout_s}, budget_ms={o.budget_ms}, "
                f"retry_s={o.retry_s}, sync_lookups={o.sync_lookups}, "
                f"lookup_wait_ms={o.lookup_wait_ms}, pending_wait_ms={o.pending_wait_ms}, "
                f"spare_rows={o.spare_rows}, "
                f"prefetch_requests={o.prefetch_requests}, "
                f"max_lookup_keys={o.max_lookup_keys}")
        # An MLA model under tensor parallelism has the same bytes on every rank: one
        # copy per block (rank 0 stores it, every rank loads it).
        self.replicated_layout = bool(config.replicated_layout)
        self.world_size = 1 if self.replicated_layout else config.parallel.world_size
        # A row holds a chunk: a page per GPU block of it, on every rank.
        self.node_world_size = self.world_size * self.blocks_per_chunk
        self.facts = current_vllm_facts()
        self._manager: TierkvOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def identity(self) -> EngineIdentity:
        """Every fact that decides this engine's block bytes (`tierkv.vllm.identity`)."""
        if self.facts is None:
            raise ValueError(
                "tierkv.vllm needs vLLM's connector to be tierkv's: set "
                f"{CONNECTOR_HINT} in --kv-transfer-config (it keys blocks by the model's "
                "revision, quantization and KV layout, and recomputes failed loads)")
        return EngineIdentity.of(self.config, self.facts, str(self.extra_config.get(
            "namespace") or ""))

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            identity = self.identity()
            if self.options.sync_lookups:  # it reads vLLM's record of a request's keys
                require_request_keys("tierkv.vllm's sync_lookups", "set sync_lookups to 0 "
                                     "in kv_connector_extra_config")
            cpu_rows = self._check_node()
            client = Client(self.address, timeout=self.timeout_s, curve=self.curve,
                            ping_s=self.ping_s, realtime_priority=self.realtime_priority)
            groups = self.config.groups
            # Spare rows are the node's, shared with every engine: an eighth at most.
            options = replace(self.options, spare_rows=min(self.options.spare_rows,
                                                           cpu_rows // SPARE_SHARE))
            self._manager = TierkvOffloadingManager(
                client, identity, [g.group_id for g in groups],
                [g.group_id for g in groups  # the field is vLLM 0.33's: 0.32 has none
                 if getattr(g, "sliding_window_size_in_chunks", None) is not None],
                self.tiers, options,
                enable_events=self.kv_events_config.enable_kv_cache_events)
            # What recomputing costs here, sent with every step's lookups.
            self._manager.prefill = prefill = PrefillRate(self.prefill_tps)
            self._manager.key_tokens = self.config.groups[0].tokens_per_block * \
                self.blocks_per_chunk
            client.recompute_rate(prefill.tokens_per_s, self._manager.key_tokens)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from tierkv.vllm.worker import TierkvOffloadingWorker

            rank = 0 if self.replicated_layout else self.config.parallel.rank
            self._worker = TierkvOffloadingWorker(
                kv_caches, self.instance, rank, self.node_world_size,
                self.blocks_per_chunk, self.config.groups[0].tokens_per_block,
                allow_unpinned=bool(self.extra_config.get("allow_unpinned", False)))
        return self._worker

    def _check_node(self) -> int:
        """The node must be up, and hold one chunk of every rank per CPU row; its
        CPU rows."""
        with SharedRegion.attach(self.instance) as region:
            if self.config.worker_kv_bytes_per_block > 0:
                check_node(region.layout.page_size, region.layout.world_size,
                           self.config.worker_kv_bytes_per_block, self.node_world_size,
                           self.instance)
            return region.layout.num_blocks


def _option(extra: Any, name: str, default: float) -> float:
    """A number from `kv_connector_extra_config`, or an error naming it."""
    value = extra.get(name, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config: {name} must be a number, got "
                         f"{value!r}") from None


_SAID: list[str] = []  # what was said of this vLLM: once per process


def _say_what_this_vllm_lacks() -> None:
    """vLLM 0.32 runs tierkv too, without two hooks 0.33 added: say so once at start."""
    import vllm

    minor = ".".join(vllm.__version__.split(".")[:2])
    if minor == "0.32" and not _SAID:
        _SAID.append(minor)
        logging.getLogger("tierkv.vllm").warning(
            "vLLM %s: it never calls on_request_access and has no request hints "
            "(kv_hints), so tierkv's policies inside vLLM learn from stores and finishes "
            "only and the node's policy is told no hints; vLLM 0.33 has both",
            vllm.__version__)
