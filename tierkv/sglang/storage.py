"""`TierkvStorage`: SGLang's HiCache L3 (`HiCacheStorage`) over a tierkv node.

SGLang builds it through its dynamic factory::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tierkv",
        "module_path": "tierkv.sglang", "class_name": "TierkvStorage",
        "interface_v1": 1, "tierkv_config": "/etc/tierkv/tierkv.toml"}'

as `TierkvStorage(storage_config, kwargs)`, then hands it the host KV pool
(`register_mem_pool_host`). With `interface_v1` SGLang calls the zero-copy pair:
`batch_set_v1` reserves rows of the node's CPU tier, copies the host pool's pages
into them with their check (`tierkv.sglang.pages`) and commits; `batch_get_v1` reads
rows pinned by the `batch_exists` before it, verifies each and copies it into the
host pool. Without it SGLang calls `batch_get`/`batch_set` with flat page tensors
(another byte order, so another namespace). Blocks move through shared memory only.

Options (the extra-config JSON): `tierkv_config` (the node's config file) or
`tierkv_instance` and `tierkv_address`; `namespace` (stands in for the model name);
`timeout_s` (each broker call, 5); `lookup_wait_s` (how long an exists query waits
for pages coming up from disk or S3, 2).

Runs on SGLang's scheduler process, called from its cache controller's threads
(see `tierkv.sglang.link`). The v2 interface (hybrid models' extra pools) is not
supported and says so: SGLang's threads stop silently on a None.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)

from tierkv.client import Client
from tierkv.node.config import load_config
from tierkv.sglang.identity import PageKeys, StorageIdentity
from tierkv.sglang.link import LinkOptions, NodeLink, guarded
from tierkv.sglang.pages import Pieces, check_page_size, payload_bytes, split_pages

log = logging.getLogger("tierkv.sglang")

UNSUPPORTED = ("tierkv serves SGLang's KV pages through the v1 interface (interface_v1: 1) "
               "or batch_get/batch_set; the v2 interface (extra pools of hybrid models) is "
               "not supported")


def link_options(extra: dict[str, Any]) -> tuple[LinkOptions, Client]:
    """The node named by the extra config, and a client of it."""
    timeout_s = _number(extra, "timeout_s", 5.0)
    wait_s = _number(extra, "lookup_wait_s", 2.0)
    if "tierkv_config" in extra:
        node = load_config(extra["tierkv_config"], starting=False)
        options = LinkOptions(node.connect_address("client"), node.instance, timeout_s, wait_s)
        return options, Client(options.address, timeout=timeout_s,
                               curve=node.client.curve_keys())
    if "tierkv_instance" in extra and "tierkv_address" in extra:
        options = LinkOptions(str(extra["tierkv_address"]), str(extra["tierkv_instance"]),
                              timeout_s, wait_s)
        return options, Client(options.address, timeout=timeout_s)
    raise ValueError("--hicache-storage-backend-extra-config needs 'tierkv_config' (the "
                     "tierkv node's config file) or 'tierkv_instance' and 'tierkv_address'")


def _number(extra: dict[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"--hicache-storage-backend-extra-config: {name} must be a "
                         f"positive number, got {value!r}")
    return float(value)


class TierkvStorage(HiCacheStorage):
    """SGLang's L3 on a tierkv node (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.extra = dict(storage_config.extra_config or {})
        options, client = link_options(self.extra)
        self.link = NodeLink(options, client)
        self.writer = storage_config.is_storage_writer
        # Which pair SGLang's controller calls: batch_get_v1/batch_set_v1 (host pool
        # pages) or batch_get/batch_set (flat page tensors); its exists queries name
        # the pages of that pair.
        self.v1 = bool(self.extra.get("interface_v1", 0))
        self.generation = 0  # `clear` starts a new one
        self.mem_pool_host: Any = None
        self._page_tokens = 0
        self._payload = 0
        self._identity: StorageIdentity | None = None
        self._paged: PageKeys | None = None  # v1: host pool pages
        self._flat: PageKeys | None = None  # batch_get/batch_set: flat page tensors
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
            "backup_bandwidth": []}

    # -- the host pool ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's page geometry and check it against the node's CPU
        pages (raises, saying the page size to configure, when they differ)."""
        super().register_mem_pool_host(mem_pool_host)
        self._page_tokens = int(mem_pool_host.page_size)
        first = torch.arange(self._page_tokens, dtype=torch.int64)
        pointers, sizes = mem_pool_host.get_page_buffer_meta(first)
        pieces = split_pages(pointers, sizes, 1)[0]
        self._payload = payload_bytes(pieces)
        check_page_size(self._payload, self.link.node_page_size())
        self._identity = StorageIdentity.of(
            self.storage_config, mem_pool_host, tuple(size for _, size in pieces),
            str(self.extra.get("namespace") or ""))
        self._scope()
        log.info("[sglang] pages of %d bytes on tierkv instance %s (%s, %s)",
                 self._payload, self.link.options.instance, mem_pool_host.layout,
                 "MLA: one rank writes" if self.storage_config.is_mla_model else "per rank")

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) != PoolName.KV.value:
            raise NotImplementedError(f"{UNSUPPORTED} (pool {host_pool_name})")
        self.register_mem_pool_host(host_pool)

    def _scope(self) -> None:
        assert self._identity is not None
        namespace = self._identity.namespace(self.generation)
        self._paged = PageKeys(namespace)
        self._flat = PageKeys(self._identity.namespace(self.generation, flat=True))

    def _keys(self, keys: list[str], flat: bool = False) -> list[bytes]:
        scoped = self._flat if flat else self._paged
        if scoped is None:
            raise RuntimeError("TierkvStorage: register_mem_pool_host was not called")
        return scoped.keys(keys)

    def _pages(self, host_indices: torch.Tensor, count: int) -> list[Pieces]:
        if host_indices.numel() != count * self._page_tokens:
            raise ValueError(f"{host_indices.numel()} host indices for {count} pages of "
                             f"{self._page_tokens} tokens")
        pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return split_pages(pointers, sizes, count)

    # -- the v1 interface ---------------------------------------------------------------

    @guarded("exists query", lambda: 0)
    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages the node holds (of the pair in use: see `v1`); they stay
        pinned for the read that follows."""
        return self.link.leading_hits(self._keys(keys, flat=not self.v1), pin=True)

    @guarded("read", lambda: None)
    def _read(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        return self.link.read(self._keys(keys), self._pages(host_indices, len(keys)),
                              self._payload)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Node -> host pool pages at `host_indices`, verified; per key whether it
        landed (a prefix)."""
        started = time.perf_counter()
        out = self._read(keys, host_indices) or [False] * len(keys)
        self._record("prefetch", sum(out), started)
        return out

    @guarded("write", lambda: None)
    def _write(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        return self.link.write(self._keys(keys), self._pages(host_indices, len(keys)),
                               self._payload)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Host pool pages at `host_indices` -> the node. An MLA rank that is not the
        writer stores nothing and says True: the writer's pages serve every rank."""
        if not self.writer:
            return [True] * len(keys)
        started = time.perf_counter()
        out = self._write(keys, host_indices) or [False] * len(keys)
        self._record("backup", sum(out), started)
        return out

    # -- flat page tensors (SGLang without interface_v1) ---------------------------------

    def _tensor_pieces(self, tensor: torch.Tensor) -> Pieces:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("TierkvStorage copies into contiguous CPU tensors only")
        size = tensor.numel() * tensor.element_size()
        if size != self._payload:
            raise ValueError(f"a page tensor of {size} bytes; this pool's pages are "
                             f"{self._payload}")
        return [(tensor.data_ptr(), size)]

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        out = self.batch_get([key], [target_location])
        return out[0]

    @guarded("read", lambda: None)
    def _read_flat(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        pages = [self._tensor_pieces(t) for t in targets]
        flat = self._keys(keys, flat=True)
        if self.link.leading_hits(flat, pin=True) == 0:
            return [False] * len(keys)
        return self.link.read(flat, pages, self._payload)

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Into the given flat page tensors; None from the first page missing."""
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("TierkvStorage.batch_get needs one target tensor per key")
        landed = self._read_flat(keys, list(target_locations)) or [False] * len(keys)
        return [t if ok else None for t, ok in zip(target_locations, landed, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    @guarded("write", lambda: None)
    def _write_flat(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        pages = [self._tensor_pieces(v.contiguous()) for v in values]
        return self.link.write(self._keys(keys, flat=True), pages, self._payload)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("TierkvStorage.batch_set needs one value tensor per key")
        if not self.writer:
            return True
        return all(self._write_flat(keys, list(values)) or [False])

    @guarded("exists query", lambda: False)
    def exists(self, key: str) -> bool:
        """Whether the node holds the page (of the pair in use; nothing is pinned)."""
        return self.link.leading_hits(self._keys([key], flat=not self.v1), pin=False) == 1

    # -- the v2 interface: not served --------------------------------------------------

    def batch_exists_v2(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(UNSUPPORTED)

    def batch_get_v2(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(UNSUPPORTED)

    def batch_set_v2(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(UNSUPPORTED)

    # -- the rest -----------------------------------------------------------------------

    def clear(self) -> bool:
        """Forget this engine's pages: a new generation of its namespace, so no page
        stored before is its hit again. Other engines on the node keep theirs (the
        node is shared; its own eviction reclaims the rows)."""
        self.generation += 1
        if self._identity is not None:
            self._scope()
        return True

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` since the last call (pages per call, GB/s)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        for name, values in self._metrics.items():
            getattr(metrics, name).extend(values)
            values.clear()
        return metrics

    def counters(self) -> dict[str, int]:
        """Pages written, read, missed, refused (no room) and failing their check."""
        return dict(self.link.counters)

    def _record(self, what: str, pages: int, started: float) -> None:
        if not self.storage_config.enable_storage_metrics or not pages:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        self._metrics[f"{what}_pgs"].append(pages)
        self._metrics[f"{what}_bandwidth"].append(pages * self._payload / seconds / 1e9)

    def close(self) -> None:
        """SGLang calls it when it detaches the backend."""
        self.link.close()
