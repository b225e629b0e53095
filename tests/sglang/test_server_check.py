"""What `tierkv.sglang.server_check` (the GPU machine's SGLang part) derives before a
server runs: the node's page size from a model's config.json, the size SGLang's
real host pools have; and that it says it skipped, never passed, without a model."""

from __future__ import annotations

import json

import pytest

from tests.sglang.pools import LAYERS, PAGE_TOKENS, SHAPES, host_pool, node_page
from tierkv.sglang import server_check

# The shapes of tests.sglang.pools' device pools, as a model's config.json says them.
CONFIGS = {
    "mha": {"num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "hidden_size": 64, "torch_dtype": "bfloat16"},
    "mla": {"num_hidden_layers": LAYERS, "num_attention_heads": 4, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "hidden_size": 64, "torch_dtype": "bfloat16"},
}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_page_size_from_a_config_is_the_real_pools(shape, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[shape.kind]))
    assert server_check.model_page(tmp_path, PAGE_TOKENS) == node_page(host_pool(shape))


def test_without_a_model_it_says_skipped(tmp_path, capsys):
    assert server_check.main(["--model", str(tmp_path)]) == server_check.SKIPPED
    assert "skipped" in capsys.readouterr().out
