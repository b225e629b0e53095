"""`tierkv demo --engine vllm`, the main job with a real engine: the demo's own run,
then vLLM through the same node; its report says time to first token with and
without tierkv's hits, and that every output is the reference's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.engine.harness import ENGINE_PYTHON

REPO = Path(__file__).resolve().parents[2]


def main_python() -> str:
    """The demo runs where the node's tiers run (.venv: the S3 tier needs moto);
    its engines run in this environment."""
    python = os.environ.get("TIERKV_MAIN_PYTHON") or str(REPO / ".venv" / "bin" / "python")
    assert Path(python).exists(), (f"no {python}: run scripts/test tests/engine (it builds "
                                   ".venv too) or set TIERKV_MAIN_PYTHON")
    return python


def test_the_demo_drives_a_real_engine_through_its_node(tmp_path, say):
    out = tmp_path / "demo"
    env = {**os.environ, "TIERKV_ENGINE_PYTHON": ENGINE_PYTHON}
    done = subprocess.run(
        [main_python(), "-m", "tierkv.cli", "demo", "--quick", "--requests", "40",
         "--engine", "vllm", "--no-progress", "--out", str(out)],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "real engine" in done.stdout
    runs = json.loads((out / "report.json").read_text())["engine"]["runs"]
    for name, run in runs.items():
        say(f"demo --engine vllm, {name}: TTFT mean {run['ttft_ms']['mean']:.0f} ms, "
            f"identical {run.get('identical', 'reference')}/{run['requests']}, cached prompt "
            f"tokens {run['cached_tokens']}")
    for name in ("tierkv, first pass", "tierkv hits"):
        assert runs[name]["identical"] == runs[name]["requests"], name
    assert runs["tierkv hits"]["cached_tokens"].get("host", 0) > 0
