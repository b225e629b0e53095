"""Prometheus metrics of the broker, served by `prometheus_client` on loopback.

The broker's state belongs to its loop thread, so the HTTP thread never reads it:
the loop hands over a fresh stats snapshot (a dict, swapped atomically) about
twice a second and scrapes render that snapshot.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierkv.node.config import ConfigError

log = logging.getLogger("broker.metrics")


class MetricsPortError(ConfigError):
    """The metrics endpoint cannot bind: the message names the key and the address."""


class BrokerMetrics(Collector):
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._snapshot: dict[str, Any] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        try:
            self.server, self.thread = start_http_server(port, addr=host,
                                                         registry=self.registry)
        except OSError as e:
            why = ("is already in use (choose another port, or 0: no metrics)"
                   if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror or e})")
            raise MetricsPortError(f"broker.metrics_port = {port}: {host}:{port} {why}") from e
        self.port = self.server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def update(self, stats: dict[str, Any]) -> None:
        self._snapshot = stats

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot
        if not s:
            return
        cpu, tiers, tiering = s["cpu"], s["tiers"], s["tiering"]
        broker = s["broker"]

        def counter(name: str, doc: str, labels: list[str],
                    rows: list[tuple[list[str], float]]) -> CounterMetricFamily:
            family = CounterMetricFamily(f"tierkv_{name}", doc, labels=labels)
            for values, value in rows:
                family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, labels: list[str],
                  rows: list[tuple[list[str], float]]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"tierkv_{name}", doc, labels=labels)
            for values, value in rows:
                family.add_metric(values, value)
            return family

        yield counter("lookups", "Lookups served by the CPU tier.", [], [([], cpu["lookups"])])
        yield counter("hit_blocks", "Blocks found: CPU hits, and promotions per tier.", ["tier"],
                      [(["cpu"], cpu["hits"])]
                      + [([n], t.get("promoted_blocks", 0)) for n, t in tiers.items()])
        yield counter("miss_blocks", "Blocks looked up that were not CPU hits.", ["tier"],
                      [(["cpu"], cpu["misses"])])
        yield counter("transfer_bytes", "Bytes moved per tier and direction.",
                      ["tier", "direction"],
                      [([n, "store"], t.get("bytes_stored", 0)) for n, t in tiers.items()]
                      + [([n, "load"], t.get("bytes_loaded", 0)) for n, t in tiers.items()])
        yield counter("transfer_seconds", "Seconds spent moving bytes per tier and direction.",
                      ["tier", "direction"],
                      [([n, "store"], t.get("seconds_store", 0)) for n, t in tiers.items()]
                      + [([n, "load"], t.get("seconds_load", 0)) for n, t in tiers.items()])
        yield counter("evictions", "Blocks evicted per tier.", ["tier"],
                      [(["cpu"], cpu["evictions"])]
                      + [([n], t.get("evictions", 0)) for n, t in tiers.items()])
        yield counter("job_failures", "Failed jobs by tier and cause.", ["tier", "cause"],
                      [([n, cause], count) for n, t in tiers.items()
                       for cause, count in t.get("failures", {}).items()]
                      + [(["gpu", "transfer"], broker["transfers_failed"])])
        yield counter("corrupt_blocks", "Blocks that failed verification at load.", ["tier"],
                      [([n], t.get("corrupt_blocks", 0)) for n, t in tiers.items()])
        yield counter("protocol_errors", "Malformed or refused messages.", [],
                      [([], broker["protocol_errors"])])
        yield gauge("jobs_in_flight", "Jobs in flight.", ["tier"],
                    [(["gpu"], s["transfers_in_flight"])]
                    + [([n], t.get("in_flight", 0)) for n, t in tiers.items()])
        yield gauge("peer_up", "Peers the broker hears from (1 ready).", ["kind", "name", "pid"],
                    [([p["kind"], p["name"], str(p["pid"])], 1.0) for p in s["peers"]])
        yield gauge("worker_pinned", "A CUDA worker's CPU tier is pinned for DMA (1) or not "
                    "(0: every copy is synchronous).", ["rank"],
                    [([p["name"]], 1.0 if p["pinned"] else 0.0) for p in s["peers"]
                     if p["kind"] == "worker" and p.get("pinned") is not None])
        yield gauge("leases", "CPU blocks leased to requests between lookup and load.", [],
                    [([], tiering.get("leases", 0))])
        yield gauge("tier_available", "A tier has a ready process.", ["tier"],
                    [([n], 1.0 if t.get("available") else 0.0) for n, t in tiers.items()])
        yield gauge("cpu_usage_ratio", "Share of CPU-tier blocks in use.", [],
                    [([], cpu["usage"])])
        yield gauge("cpu_blocks", "CPU-tier blocks by state.", ["state"],
                    [(["ready"], cpu["blocks_ready"]), (["writing"], cpu["blocks_writing"]),
                     (["free"], cpu["blocks_free"])])
        yield gauge("tier_blocks", "Blocks held per secondary tier.", ["tier"],
                    [([n], t.get("blocks", 0)) for n, t in tiers.items()])
        yield counter("promotions", "Promotions by outcome.", ["outcome"],
                      [([o], tiering[f"promotions_{o}"])
                       for o in ("started", "landed", "failed", "refused", "overrun")])
        yield counter("slower_than_recompute_blocks", "Blocks a tier held that lookups left "
                      "to recompute: loading them was expected to take longer.", ["tier"],
                      [([n], t.get("slower_than_recompute", 0)) for n, t in tiers.items()])
        yield counter("background_promotion_blocks", "Blocks promoted while their tier was "
                      "idle, after a request had recomputed them.", [],
                      [([], tiering.get("background_promotions", 0))])
        costs = [(n, t["load_cost"]) for n, t in tiers.items() if "load_cost" in t]
        yield gauge("load_latency_seconds", "A tier's promotion latency, as estimated.",
                    ["tier"], [([n], c["latency_ms"] / 1e3) for n, c in costs])
        yield gauge("load_bandwidth_bytes", "A tier's promotion bandwidth in bytes/s, as "
                    "estimated.", ["tier"], [([n], c["bandwidth_mb_s"] * 1e6) for n, c in costs])
