"""tierkv inside vLLM 0.33: an OffloadingSpec backed by a tierkv node, and tierkv's
policies as vLLM cache policies.

* `TierkvConnector` (`kv_connector` "TierkvConnector", `kv_connector_module_path`
  "tierkv.vllm.connector") with `TierkvOffloadingSpec` (`spec_name`
  "TierkvOffloadingSpec", `spec_module_path` "tierkv.vllm"): vLLM's offloading
  connector offloads into a running tierkv node; engines on one host share its CPU,
  disk and S3 tiers. See README "Use with vLLM".
* `tierkv.vllm.policies`: tierkv's eviction policies inside vLLM's own CPU offloading,
  no tierkv process at all.

Nothing here is imported by the rest of tierkv; it needs `pip install 'tierkv[vllm]'`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierkvConnector", "TierkvOffloadingSpec"]


def __getattr__(name: str) -> Any:
    # Loaded on first use, so `tierkv.vllm.policies` does not pull in the client.
    if name == "TierkvOffloadingSpec":
        from tierkv.vllm.spec import TierkvOffloadingSpec

        return TierkvOffloadingSpec
    if name == "TierkvConnector":
        from tierkv.vllm.connector import TierkvConnector

        return TierkvConnector
    raise AttributeError(f"module 'tierkv.vllm' has no attribute {name!r}")
