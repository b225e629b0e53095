"""The engine's side of tierkv: describing its KV cache (`layout`), exporting it to a
gpu worker (`kvcache`: CUDA IPC handles, or CPU tensors in shared memory) and, in the
worker, opening what was exported (`opened`).

    from tierkv.engine import KVLayout, allocate_kv_cache
    layout = KVLayout.per_layer(num_layers=2, num_blocks=64, block_size_tokens=16,
                                num_kv_heads=4, head_dim=64, dtype="float16")
    with allocate_kv_cache("mynode", rank=0, layout=layout) as kv:
        client.register_kv(0, kv.registration())

The engine contract (what a worker's copies rely on; `workers.gpu.transfer` checks
what it can):

* CUDA KV caches come from torch's native caching allocator and stay alive until
  the engine closes its `KVCache` (memory of cudaMallocAsync, expandable segments or
  a pluggable / sleep-mode pool cannot be exported: registration fails naming the
  setting).
* Load only into GPU blocks allocated for the request and not yet computed, and
  read them only after the client saw the load finish.
* Store only blocks whose engine step finished on the host; do not overwrite or
  free them before the client saw the store finish.
* A load into a block that a store in flight still reads, or a store of a block a
  load in flight is still writing, is refused (``bad_request``).
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
