"""The engine's side of tierkv: describing its KV cache (`layout`), exporting it to a
gpu worker (`kvcache`: CUDA IPC handles, or CPU tensors in shared memory) and, in the
worker, opening what was exported (`opened`).

    from tierkv.engine import KVLayout, allocate_kv_cache
    layout = KVLayout.per_layer(num_layers=2, num_blocks=64, block_size_tokens=16,
                                num_kv_heads=4, head_dim=64, dtype="float16")
    with allocate_kv_cache("mynode", rank=0, layout=layout) as kv:
        client.register_kv(0, kv.registration())
"""

from tierkv.engine.kvcache import KVCache, allocate_kv_cache
from tierkv.engine.layout import (
    DTYPE_SIZES,
    REGISTRATION_VERSION,
    KVCacheError,
    KVLayout,
    KVLayoutError,
    block_views,
    check_tensors,
)
from tierkv.engine.opened import OpenedKV, open_kv_cache
from tierkv.engine.segments import kv_segment_name, sweep_stale_kv_segments

__all__ = ["DTYPE_SIZES", "REGISTRATION_VERSION", "KVCache", "KVCacheError", "KVLayout",
           "KVLayoutError", "OpenedKV", "allocate_kv_cache", "block_views", "check_tensors",
           "kv_segment_name", "open_kv_cache", "sweep_stale_kv_segments"]
