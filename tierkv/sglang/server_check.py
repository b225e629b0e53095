"""A real SGLang server with tierkv as its HiCache L3, on a machine with a GPU
(`scripts/gpu-check` runs it when SGLang and a model are there):

    python -m tierkv.sglang.server_check --model PATH [--page-size 64] [--timeout 900]

A node (broker and CPU tier; SGLang copies its own host pages) sized for the model's
pages, an SGLang server on loopback with `--enable-hierarchical-cache` and the tierkv
backend, and a workload of questions about shared documents, greedy, run twice: the
second pass after SGLang's own caches are flushed, so that what it reuses comes back
from tierkv. Passes when the node served hits in the second pass and every output is
token for token the first pass's. Exit status 0 passed, 1 failed, 4 skipped (no
SGLang here, or no model: the CPU suite in tests/sglang covers the backend's classes).

The server and the node are ended by pid, also on a failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tierkv.sglang.pages import model_page_payload, node_page_bytes

SKIPPED = 4
DOCUMENTS, QUESTIONS, DOC_TOKENS = 4, 3, 2048
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def model_page(model: Path, page_tokens: int) -> int:
    """The node's `cpu.page_size` for this model's SGLang host pages, from its
    config.json (TP 1)."""
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config", config)
    layers = int(text["num_hidden_layers"])
    dtype = DTYPE_BYTES.get(str(text.get("torch_dtype", config.get("torch_dtype", "bfloat16"))), 2)
    if text.get("kv_lora_rank"):  # MLA (DeepSeek-style)
        payload = model_page_payload(page_tokens, layers, dtype, mla_dims=int(
            text["kv_lora_rank"]) + int(text["qk_rope_head_dim"]))
    else:
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        payload = model_page_payload(page_tokens, layers, dtype, kv_heads, head_dim)
    return node_page_bytes(payload)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read() or b"null")


def wait_healthy(url: str, server: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the SGLang server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(2)
    raise RuntimeError(f"the SGLang server was not healthy within {timeout_s:.0f} s")


def prompts(seed: int = 7) -> list[str]:
    """Questions about shared documents, as words (any tokenizer splits them)."""
    rng = random.Random(seed)
    words = [f"w{rng.randrange(5000)}" for _ in range(DOCUMENTS * DOC_TOKENS)]
    docs = [" ".join(words[i * DOC_TOKENS:(i + 1) * DOC_TOKENS]) for i in range(DOCUMENTS)]
    return [f"{doc}\nQuestion {q}: which word came first?" for q in range(QUESTIONS)
            for doc in docs]


def run_pass(url: str, texts: list[str], timeout_s: float) -> list[list[int]]:
    out = []
    for text in texts:
        reply = post(f"{url}/generate", {"text": text, "sampling_params": {
            "temperature": 0, "max_new_tokens": 16}}, timeout_s)
        out.append(reply.get("output_ids") or reply["text"])
    return out


def node_hits(config: Any) -> int:
    from tierkv.client import Client

    with Client.from_config(config) as client:
        return int(client.stats()["cpu"].get("hits", 0))


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def check(model: Path, page_tokens: int, timeout_s: float, work: Path) -> bool:
    from tierkv.node.config import config_from_dict
    from tierkv.node.supervisor import Node

    config = config_from_dict({
        "instance": f"sglcheck{int(time.time())}", "run_dir": str(work / "run"),
        "cpu": {"num_blocks": 2048, "page_size": model_page(model, page_tokens),
                "world_size": 1},
        "worker": {"enabled": False}, "tiers": []}, "<tierkv.sglang.server_check>")
    node = Node(config)
    node.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = {"backend_name": "tierkv", "module_path": "tierkv.sglang",
             "class_name": "TierkvStorage", "interface_v1": 1,
             "tierkv_config": str(node.config_path)}
    log = open(work / "sglang.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
         "--host", "127.0.0.1", "--port", str(port), "--page-size", str(page_tokens),
         # Every page backed up at once (the default waits for a page's reuse).
         "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
         "--hicache-storage-backend", "dynamic",
         "--hicache-storage-backend-extra-config", json.dumps(extra)],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server, timeout_s)
        texts = prompts()
        first = run_pass(url, texts, timeout_s)
        time.sleep(5)  # SGLang's backup thread writes to tierkv behind the requests
        post(f"{url}/flush_cache", {}, timeout_s)
        before = node_hits(config)
        second = run_pass(url, texts, timeout_s)
        hits = node_hits(config) - before
        same = sum(a == b for a, b in zip(first, second, strict=True))
        print(f"[sglang] {len(texts)} prompts twice: {same}/{len(texts)} identical; "
              f"{hits} pages served by tierkv in the second pass")
        return same == len(texts) and hits > 0
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        print(f"[sglang] failed: {e}; the server's log: {work / 'sglang.log'}")
        return False
    finally:
        stop(server)
        log.close()
        node.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.sglang.server_check",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="a local model directory (the GPU machine has no network)")
    parser.add_argument("--page-size", type=int, default=64, help="SGLang's page, tokens")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="for the server to come up, and for each request")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("sglang") is None:
        print(f"[sglang] skipped: SGLang is not installed for {sys.executable}")
        return SKIPPED
    if args.model is None or not (args.model / "config.json").exists():
        print("[sglang] skipped: no model (--model DIR holding config.json)")
        return SKIPPED
    with tempfile.TemporaryDirectory(prefix="tierkv-sglang-check-") as tmp:
        return 0 if check(args.model, args.page_size, args.timeout, Path(tmp)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
