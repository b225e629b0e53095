"""`TierkvOffloadingSpec`: what vLLM's `OffloadingConnector` loads by name.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TierkvOffloadingSpec",
        "spec_module_path": "tierkv.vllm", "tierkv_config": "/etc/tierkv/node.toml"}}'

Extra config read here (`kv_connector_extra_config`):

* ``tierkv_config``: the node's config file (its broker address, instance name,
  client keys); or ``tierkv_instance`` and ``tierkv_address`` given directly.
* ``namespace``: engines with the same namespace share blocks (default: derived
  from the model, KV dtype, block geometry and parallel layout).
* ``timeout_s`` (2.0): how long a scheduler step waits for the broker before it
  goes on without tierkv for ``retry_s`` (5.0).
* ``sync_lookups`` (2): requests a step looks up in a round trip of their own; the
  step's later requests are looked up with its end-of-step round trip and
  scheduled one step later (see `tierkv.vllm.manager`).
* ``block_size``: vLLM's own (tokens per offloaded chunk).
"""

from __future__ import annotations

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

from tierkv.client import Client
from tierkv.core.shm import SharedRegion
from tierkv.node.config import load_config, tier_name
from tierkv.vllm.layout import KeyMap, check_node, namespace
from tierkv.vllm.manager import Metrics, TierkvOffloadingManager


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
                "Blocks not stored: present already, or no room in the CPU tier now."),
            Metrics.ROUND_TRIPS: counter("Round trips to the tierkv broker."),
            Metrics.BROKER_FAILURES: counter(
                "Round trips the tierkv broker did not answer in time."),
            Metrics.ROUND_TRIP_SECONDS: OffloadingHistogramMetadata(
                documentation="Seconds of one round trip to the tierkv broker.",
                buckets=(1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0)),
        }

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
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
        elif "tierkv_instance" in extra and "tierkv_address" in extra:
            self.instance = str(extra["tierkv_instance"])
            self.address = str(extra["tierkv_address"])
            self.curve = None
            self.tiers = []
        else:
            raise ValueError("kv_connector_extra_config needs 'tierkv_config' (the tierkv "
                             "node's config file) or 'tierkv_instance' and 'tierkv_address'")
        self.timeout_s = float(extra.get("timeout_s", 2.0))
        self.sync_lookups = int(extra.get("sync_lookups", 2))
        self.retry_s = float(extra.get("retry_s", 5.0))
        if self.timeout_s <= 0 or self.retry_s < 0 or self.sync_lookups < 0:
            raise ValueError(f"timeout_s must be > 0, retry_s and sync_lookups >= 0, got "
                             f"{self.timeout_s}, {self.retry_s}, {self.sync_lookups}")
        self.world_size = config.parallel.world_size
        self.keymap = KeyMap(self._namespace(), self.blocks_per_chunk)
        self._manager: TierkvOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def _namespace(self) -> bytes:
        explicit = self.extra_config.get("namespace")
        if explicit:
            return namespace("explicit", explicit)
        c = self.config
        return namespace(c.model.name, c.model.dtype, c.kv_cache_layout,
                         [(g.group_id, g.tokens_per_block) for g in c.groups],
                         c.worker_kv_bytes_per_block, c.parallel.world_size,
                         c.cache.tokens_per_hash, c.cache.blocks_per_chunk)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._check_node()
            client = Client(self.address, timeout=self.timeout_s, curve=self.curve)
            self._manager = TierkvOffloadingManager(
                client, self.keymap, [g.group_id for g in self.config.groups], self.tiers,
                retry_s=self.retry_s, sync_lookups=self.sync_lookups,
                enable_events=self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from tierkv.vllm.worker import TierkvOffloadingWorker

            self._worker = TierkvOffloadingWorker(
                kv_caches, self.instance, self.config.parallel.rank, self.world_size,
                self.blocks_per_chunk, self.config.groups[0].tokens_per_block)
        return self._worker

    def _check_node(self) -> None:
        """The node must be up, and hold one GPU block of every rank per CPU row."""
        with SharedRegion.attach(self.instance) as region:
            if self.config.worker_kv_bytes_per_block > 0:
                check_node(region.layout.page_size, region.layout.world_size,
                           self.config.worker_kv_bytes_per_block, self.world_size,
                           self.instance)
