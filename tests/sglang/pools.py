"""SGLang's real host KV pools on the CPU, filled with known bytes, and the backend
built the way SGLang builds it; also run as a process (`python -m tests.sglang.pools
WRITE|READ ...`): a second SGLang instance on the same node."""

from __future__ import annotations

import ctypes
import json
import sys
from dataclasses import dataclass
from typing import Any

import torch

PAGE_TOKENS = 4
LAYERS = 3
TOKENS = 64  # device pool; the host pool holds twice as many
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PoolShape:
    kind: str  # "mha" or "mla"
    layout: str

    def __str__(self) -> str:
        return f"{self.kind}-{self.layout}"


SHAPES = [PoolShape("mha", lay) for lay in MHA_LAYOUTS] + \
         [PoolShape("mla", lay) for lay in MLA_LAYOUTS]


def ensure_sglang() -> None:
    """For a process of its own: `import sglang`, then the torchvision stand-in."""
    import tests.sglang.conftest  # noqa: F401  (installs it)


def device_pool(kind: str) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind == "mha":
        return MHATokenToKVPool(size=TOKENS, page_size=PAGE_TOKENS, dtype=torch.bfloat16,
                                head_num=2, head_dim=8, layer_num=LAYERS, device="cpu",
                                enable_memory_saver=False)
    return MLATokenToKVPool(size=TOKENS, page_size=PAGE_TOKENS, dtype=torch.bfloat16,
                            kv_lora_rank=16, qk_rope_head_dim=8, layer_num=LAYERS,
                            device="cpu", enable_memory_saver=False)


def host_pool(shape: PoolShape, device: Any = None) -> Any:
    """A host pool over a CPU device pool's buffers, unpinned (no CUDA here)."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = device if device is not None else device_pool(shape.kind)
    info = device.get_device_pool_infos()[0].buffer_info
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=TOKENS,
                  start_layer=0, end_layer=LAYERS)
    if shape.kind == "mha":
        return MHATokenToKVPoolHost(info, 2.0, 0, PAGE_TOKENS, shape.layout, **common)
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE_TOKENS, shape.layout,
                                target_layer_num=LAYERS, **common)


def storage_config(mla: bool, extra: dict[str, Any], tp_rank: int = 0, tp_size: int = 1,
                   page_first: bool = False) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=page_first, model_name="tiny/test-model", extra_config=extra)


def extra_config(node: Any, **more: Any) -> dict[str, Any]:
    """The `--hicache-storage-backend-extra-config` JSON a user writes, parsed."""
    text = json.dumps({"backend_name": "tierkv", "module_path": "tierkv.sglang",
                       "class_name": "TierkvStorage", "interface_v1": 1,
                       "tierkv_config": str(node.config_path), **more})
    return json.loads(text)


def backend_for(pool: Any, shape: PoolShape, extra: dict[str, Any], **config: Any) -> Any:
    """Built by SGLang's factory as `--hicache-storage-backend dynamic` builds it."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    storage = StorageBackendFactory.create_backend(
        "dynamic", storage_config(shape.kind == "mla", extra, **config), pool)
    storage.register_mem_pool_host(pool)
    storage.on_host_pools_registered()
    return storage


def page_keys(n: int, seed: int = 0) -> list[str]:
    """SGLang-like page keys: 64 hex digits each."""
    import hashlib

    return [hashlib.sha256(f"{seed}:{i}".encode()).hexdigest() for i in range(n)]


def indices(first_page: int, pages: int) -> torch.Tensor:
    start = first_page * PAGE_TOKENS
    return torch.arange(start, start + pages * PAGE_TOKENS, dtype=torch.int64)


def page_bytes(pool: Any, first_page: int, pages: int) -> list[bytes]:
    """Each page's bytes, as the host pool lays them out (its pieces, in order)."""
    return bytes_at(pool, indices(first_page, pages))


def fill_pages(pool: Any, first_page: int, pages: int, seed: int) -> list[bytes]:
    """Write known bytes into pages (every piece of each); returns them."""
    return fill_at(pool, indices(first_page, pages), seed)


def bytes_at(pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    """The bytes of the pages at `host_indices` (whole pages, in order)."""
    from tierkv.sglang.pages import split_pages

    pointers, sizes = pool.get_page_buffer_meta(host_indices)
    return [b"".join(ctypes.string_at(a, s) for a, s in page)
            for page in split_pages(pointers, sizes, host_indices.numel() // PAGE_TOKENS)]


def fill_at(pool: Any, host_indices: torch.Tensor, seed: int) -> list[bytes]:
    """Write known bytes into the pages at `host_indices`; returns them."""
    import random

    from tierkv.sglang.pages import split_pages

    rng = random.Random(seed)
    pointers, sizes = pool.get_page_buffer_meta(host_indices)
    for page in split_pages(pointers, sizes, host_indices.numel() // PAGE_TOKENS):
        for address, size in page:
            data = rng.randbytes(size)
            ctypes.memmove(address, data, size)
    return bytes_at(pool, host_indices)


def node_page(pool: Any) -> int:
    """The `cpu.page_size` a node needs for this pool: its page and the check."""
    from tierkv.sglang.pages import CHECK_BYTES, payload_bytes, split_pages

    pointers, sizes = pool.get_page_buffer_meta(indices(0, 1))
    return payload_bytes(split_pages(pointers, sizes, 1)[0]) + CHECK_BYTES


def _main(argv: list[str]) -> int:
    """WRITE|READ config_path kind layout pages seed: one SGLang instance's pool."""
    ensure_sglang()
    what, config_path, kind, layout, pages, seed = argv
    shape = PoolShape(kind, layout)
    pool = host_pool(shape)
    extra = {"backend_name": "tierkv", "module_path": "tierkv.sglang",
             "class_name": "TierkvStorage", "interface_v1": 1, "tierkv_config": config_path}
    storage = backend_for(pool, shape, extra)
    keys = page_keys(int(pages), int(seed))
    try:
        if what == "WRITE":
            fill_pages(pool, 0, int(pages), int(seed))
            ok = storage.batch_set_v1(keys, indices(0, int(pages)))
            print(json.dumps({"written": sum(ok)}))
        else:
            hits = storage.batch_exists(keys)
            ok = storage.batch_get_v1(keys[:hits], indices(0, hits))
            print(json.dumps({"hits": hits, "read": sum(ok),
                              "pages": [p.hex() for p in page_bytes(pool, 0, hits)]}))
    finally:
        storage.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
