"""Which vLLM engines share blocks (`tierkv.vllm.identity`): every fact that changes a
block's bytes is in the namespace, and nothing else is.

Built from vLLM 0.33's own config classes (`OffloadingConfig` as its connector makes
it, `VllmFacts` read from a real `VllmConfig` and `KVCacheConfig`), no node needed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from tests.vllm.conftest import SHAPE
from tierkv.vllm.identity import EngineIdentity, VllmFacts

FACTS = VllmFacts(revision="0123abc", quantization="", kv_specs=("FullAttentionSpec(...)",),
                  kv_packing=((2, 4096, True),), vllm_version="0.33")


def config(tp: int = 1, pp: int = 1, pcp: int = 1, dcp: int = 1, rank: int = 0,
           replicated: bool = False, model: str = "m", dtype: str = "bfloat16",
           extra: dict[str, Any] | None = None) -> OffloadingConfig:
    world = tp * pp * pcp
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("model.layers.0.self_attn.attn",), 0),),
        worker_kv_bytes_per_block=1 << 21, enable_kv_cache_events=False,
        extra_config=extra or {}, engine_id="engine",
        model=OffloadingModelConfig(model, dtype), cache=OffloadingCacheConfig(16, 1),
        parallel=OffloadingParallelConfig(rank, world, tp, pp, pcp, dcp, 0, 1, None, False),
        replicated_layout=replicated)


def ns(cfg: OffloadingConfig, facts: VllmFacts = FACTS, explicit: str = "",
       generation: int = 0) -> bytes:
    return EngineIdentity.of(cfg, facts, explicit).namespace(generation)


def test_every_rank_of_one_engine_has_the_engines_namespace():
    assert ns(config(tp=2, rank=0)) == ns(config(tp=2, rank=1)) == ns(config(tp=2))


@pytest.mark.parametrize("a, b", [
    (config(tp=2), config(pp=2)),  # the same world size, other bytes per rank
    (config(tp=2), config(pcp=2)),
    (config(tp=2), config(tp=2, dcp=2)),
    (config(tp=2), config(tp=2, replicated=True)),
    (config(), config(dtype="fp8_e4m3")),
])
def test_engines_of_other_layouts_never_share(a, b):
    assert ns(a) != ns(b)


@pytest.mark.parametrize("other", [
    replace(FACTS, revision="4567def"),
    replace(FACTS, quantization="awq"),
    replace(FACTS, kv_specs=("FullAttentionSpec(... block_stride_alignment=MultipleOf(8))",)),
    replace(FACTS, kv_packing=((2, 4096, False),)),
    replace(FACTS, vllm_version="0.34"),
])
def test_other_weights_or_kv_byte_layouts_never_share(other):
    assert ns(config(), other) != ns(config(), FACTS)


def test_a_reset_generation_is_a_namespace_of_its_own():
    assert ns(config(), generation=1) != ns(config(), generation=0)
    assert ns(config(), generation=1) == ns(config(), generation=1)


def test_an_explicit_namespace_names_the_model_but_not_the_layout():
    assert ns(config(model="a"), explicit="llama") == ns(config(model="b"), explicit="llama")
    assert ns(config(model="a"), explicit="llama") != ns(config(model="a"))
    assert ns(config(tp=2), explicit="llama") != ns(config(pp=2), explicit="llama")


def test_the_kernel_block_split_reaches_the_namespace_from_vllms_kv_specs():
    """vLLM's KV spec carries the attention backend's kernel block split (its block
    stride alignment): two engines whose backends split a block differently differ."""
    from vllm.v1.attention.backend import MultipleOf

    from tierkv.bench.vllm_engine import kv_cache_config, vllm_config

    vcfg = vllm_config(SHAPE, {})
    kv = kv_cache_config(SHAPE)
    split = replace(kv, kv_cache_groups=[replace(g, kv_cache_spec=replace(
        g.kv_cache_spec, block_stride_alignment=MultipleOf(8))) for g in kv.kv_cache_groups])
    facts, split_facts = VllmFacts.of(vcfg, kv, (0,)), VllmFacts.of(vcfg, split, (0,))
    assert facts.kv_specs != split_facts.kv_specs
    assert ns(config(), facts) != ns(config(), split_facts)


def test_an_mla_model_under_tensor_parallelism_is_stored_once():
    """vLLM's replicated layout (MLA under TP: every rank holds the same bytes): one
    page per row, written by rank 0 only (vLLM gates the stores on the spec's
    `replicated_layout`), read by every rank."""
    from tierkv.vllm.spec import TierkvOffloadingSpec

    extra = {"tierkv_instance": "t", "tierkv_address": "ipc:///nonexistent"}
    replicated = TierkvOffloadingSpec(config(tp=4, replicated=True, extra=extra))
    assert replicated.replicated_layout and replicated.world_size == 1
    sharded = TierkvOffloadingSpec(config(tp=4, extra=extra))
    assert not sharded.replicated_layout and sharded.world_size == 4


def test_without_tierkvs_connector_the_engine_is_told_what_to_set():
    from tierkv.vllm.spec import TierkvOffloadingSpec

    spec = TierkvOffloadingSpec(config(extra={"tierkv_instance": "t",
                                              "tierkv_address": "ipc:///nonexistent"}))
    with pytest.raises(ValueError, match='"kv_connector": "TierkvConnector"'):
        spec.get_manager()


@pytest.mark.parametrize("key, value, error", [
    ("budget_ms", "fast", "budget_ms must be a number, got 'fast'"),
    ("budget_ms", -1, "budget_ms=-1.0"),
    ("timeout_s", 0, "timeout_s must be > 0"),
    ("max_lookup_keys", 0, "max_lookup_keys=0"),
    ("spare_rows", -1, "spare_rows=-1"),
    ("prefetch_requests", "many", "prefetch_requests must be a number, got 'many'"),
    ("realtime_priority", 100, r"realtime_priority must be an integer 0\.\.99"),
])
def test_a_bad_option_is_refused_naming_it(key, value, error):
    from tierkv.vllm.spec import TierkvOffloadingSpec

    extra = {"tierkv_instance": "t", "tierkv_address": "ipc:///nonexistent", key: value}
    with pytest.raises(ValueError, match=error):
        TierkvOffloadingSpec(config(extra=extra))
