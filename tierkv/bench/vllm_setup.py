"""What the stand-in vLLM engine (`tierkv.bench.vllm_engine`) is built from, apart
from vLLM's scheduler: the tiny model's config (no weights), the KV geometry of its
CPU tensors and vLLM's KV-cache config for it, and the tierkv node it runs against.
Kept apart from the engine's step loop so that a test or benchmark that only sizes
a node, or reads the geometry, does not read the engine.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierkv.bench.engine_nodes import node_config
from tierkv.node.supervisor import Node

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before vLLM (and the hub) is imported
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

EOS = 2
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "intermediate_size": 128, "vocab_size": 32000, "max_position_embeddings": 1 << 16,
    "torch_dtype": "float32", "rms_norm_eps": 1e-5, "eos_token_id": EOS,
}



@dataclass(frozen=True)
class EngineShape:
    """The stand-in model's KV geometry: `layers` tensors of ``(blocks, 2,
    block_size, kv_heads, head_dim)`` float32 (vLLM's per-layer layout)."""

    gpu_blocks: int = 64
    block_size: int = 16
    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 16
    max_num_seqs: int = 16
    max_batched_tokens: int = 2048
    max_model_len: int = 16384
    # > 0: a hybrid model, the odd layers in a second KV-cache group attending to
    # this many trailing tokens (vLLM's sliding window); 0: one full-attention group.
    sliding_window: int = 0

    @property
    def layer_page_bytes(self) -> int:
        return 2 * self.block_size * self.kv_heads * self.head_dim * 4

    @property
    def page_size(self) -> int:
        """Bytes of one GPU block, every layer: a tierkv node's `cpu.page_size`."""
        return self.layers * self.layer_page_bytes


@contextmanager
def engine_node(page_size: int, cpu_blocks: int, disk_blocks: int = 0,
                **sections: Any) -> Iterator[Node]:
    """A node started in a temporary directory, stopped (by pid) and removed on exit."""
    with tempfile.TemporaryDirectory(prefix="tierkv-vllm-") as tmp:
        node = Node(node_config(f"vllm{uuid.uuid4().hex[:8]}", Path(tmp), page_size,
                                cpu_blocks, disk_blocks, **sections))
        node.start()
        try:
            yield node
        finally:
            node.stop()


# The stand-in model computes nothing, so its steps say nothing of what recomputing
# costs: the engine says the rate of the GPU engine it stands in for (an 8B model
# on an H100), and the load-or-recompute rule weighs promotions against that.
STAND_IN_PREFILL_TPS = 15_000.0


def tierkv_extra_config(node: Node, **more: Any) -> dict[str, Any]:
    """`kv_connector_extra_config` for a vLLM engine on `node` (its connector is
    `TierkvConnector`, see `vllm_config`)."""
    return {"spec_name": "TierkvOffloadingSpec", "spec_module_path": "tierkv.vllm",
            "tierkv_config": str(node.config_path),
            "prefill_tokens_per_s": STAND_IN_PREFILL_TPS, **more}


def model_dir() -> Path:
    """A directory holding the tiny model's config.json (made once per process)."""
    path = Path(tempfile.gettempdir()) / f"tierkv-vllm-tiny-{os.getuid()}"
    path.mkdir(exist_ok=True)
    config = path / "config.json"
    text = json.dumps(TINY_MODEL)
    if not config.exists() or config.read_text() != text:
        tmp = path / f".config.{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(config)
    return path


def kv_cache_config(shape: EngineShape) -> KVCacheConfig:
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
    geometry: dict[str, Any] = dict(block_size=shape.block_size, num_kv_heads=shape.kv_heads,
                                    head_size=shape.head_dim, dtype=torch.float32)
    page = shape.layer_page_bytes
    # One allocation, layer after layer (vLLM's layer-outermost placement); a block id
    # belongs to one group at a time, whose layers' pages it uses.
    tensor = KVCacheTensor(size=shape.gpu_blocks * shape.page_size, layers=layers,
                           layer_stride=page * shape.gpu_blocks, block_stride=page)
    if shape.sliding_window:
        groups = [KVCacheGroupSpec(layers[0::2], FullAttentionSpec(**geometry)),
                  KVCacheGroupSpec(layers[1::2], SlidingWindowSpec(
                      sliding_window=shape.sliding_window, **geometry))]
    else:
        groups = [KVCacheGroupSpec(layers, FullAttentionSpec(**geometry))]
    return KVCacheConfig(num_blocks=shape.gpu_blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=groups)
