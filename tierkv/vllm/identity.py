"""What makes two vLLM engines' blocks interchangeable, and the namespace it gives.

Engines that agree on every fact here write the same bytes for the same tokens, so
they share blocks on one node (a prefix one stored is a hit for the other); engines
that differ in any of them must never read each other's bytes. The facts:

* the model (name, resolved revision, weight quantization), the KV cache's dtype
  and byte layout (`kv_cache_layout`, each offloaded group's KV spec, which carries
  the kernel block split through its block-stride alignment, and how the engine's
  KV tensors are packed);
* the whole parallel layout: TP, PP, prefill and decode context parallel sizes and
  the world size (a rank's place in it follows from them in vLLM's rank order, so
  the page a rank writes is the same page in every engine of the layout), and
  whether the layout is replicated (an MLA model under TP keeps one copy per block);
* the offloading geometry (tokens per hash, blocks per chunk, bytes per block);
* vLLM's minor version (its block hashes and rank order are its own);
* and this engine's reset generation: `reset_cache` (vLLM's weight-update path)
  starts a new generation, so a block stored before the reset is never this engine's
  hit again, while engines that did not reset keep theirs. Engines that reset the
  same number of times since they started (RL trainers reset them all at each sync)
  share blocks again.

vLLM hands an `OffloadingSpec` only the facts of `OffloadingConfig`; the model's
revision and quantization and the KV specs live in the `VllmConfig` and
`KVCacheConfig` its connector gets. `tierkv.vllm.connector.TierkvConnector` reads
them there and hands them to the spec it builds (`vllm_facts_for`); a spec built by
another connector has none, and refuses to start rather than guess. A user's
`namespace` stands in for the model's identity, never for the byte layout.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

from tierkv.vllm.layout import namespace

_FACTS: contextvars.ContextVar[VllmFacts | None] = contextvars.ContextVar(
    "tierkv_vllm_facts", default=None)


@dataclass(frozen=True, slots=True)
class VllmFacts:
    """What only the connector sees: the model's weights and the KV byte layout."""

    revision: str
    quantization: str
    kv_specs: tuple[str, ...]  # each offloaded group's KV cache spec (repr)
    # Per KV tensor: its layers, its block stride, whether layers are outermost.
    kv_packing: tuple[tuple[int, int, bool], ...]
    vllm_version: str

    @classmethod
    def of(cls, vllm_config: Any, kv_cache_config: Any, group_ids: tuple[int, ...]) -> VllmFacts:
        """Read from vLLM's configs (scheduler and worker roles see the same)."""
        import vllm

        model = vllm_config.model_config
        groups = kv_cache_config.kv_cache_groups
        packing = tuple((len(t.layers), int(t.block_stride or 0),
                         bool((t.layer_stride or 0) > (t.block_stride or 0)))
                        for t in kv_cache_config.kv_cache_tensors)
        return cls(revision=str(model.revision or ""),
                   quantization=str(model.quantization or ""),
                   kv_specs=tuple(repr(groups[g].kv_cache_spec) for g in group_ids),
                   kv_packing=packing,
                   vllm_version=".".join(vllm.__version__.split(".")[:2]))


@contextmanager
def vllm_facts_for(facts: VllmFacts) -> Iterator[None]:
    """The facts the spec built inside this block reads (`current_vllm_facts`)."""
    token = _FACTS.set(facts)
    try:
        yield
    finally:
        _FACTS.reset(token)


def current_vllm_facts() -> VllmFacts | None:
    """The facts of the connector building this spec (None: not TierkvConnector)."""
    return _FACTS.get()


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """Every fact that decides a block's bytes (see the module docstring). An
    explicit `namespace` from the user stands in for the model's identity (name,
    revision, quantization), never for the byte layout."""

    model: tuple[str, ...]  # name, revision, quantization; or ("explicit", namespace)
    kv_dtype: str
    kv_cache_layout: str
    groups: tuple[tuple[int, int, int | None], ...]  # (group id, tokens/block, window)
    kv_specs: tuple[str, ...]
    kv_packing: tuple[tuple[int, int, bool], ...]
    kv_bytes_per_block: int
    tokens_per_hash: int
    blocks_per_chunk: int
    parallel: tuple[int, int, int, int, int]  # tp, pp, pcp, dcp, world size
    replicated: bool
    vllm_version: str

    @classmethod
    def of(cls, config: Any, facts: VllmFacts, explicit: str = "") -> EngineIdentity:
        """From vLLM's `OffloadingConfig` and the connector's facts."""
        p = config.parallel
        model = (("explicit", explicit) if explicit
                 else (config.model.name, facts.revision, facts.quantization))
        return cls(
            model=model, kv_dtype=config.model.dtype,
            kv_cache_layout=str(config.kv_cache_layout or ""),
            groups=tuple((g.group_id, g.tokens_per_block,
                          getattr(g, "sliding_window_size_in_chunks", None))  # 0.33 only
                         for g in config.groups),
            kv_specs=facts.kv_specs, kv_packing=facts.kv_packing,
            kv_bytes_per_block=config.worker_kv_bytes_per_block,
            tokens_per_hash=config.cache.tokens_per_hash,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            parallel=(p.tp_size, p.pp_size, p.pcp_size, p.dcp_size, p.world_size),
            replicated=bool(config.replicated_layout), vllm_version=facts.vllm_version)

    def namespace(self, generation: int = 0) -> bytes:
        """The key prefix of this engine's blocks in reset generation `generation`."""
        return namespace(*(getattr(self, f.name) for f in fields(self)), generation)
