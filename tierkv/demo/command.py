"""`tierkv demo`: a whole node on an embedded default, driven like an inference engine.

The node: the broker, a CPU worker, a disk tier in a temporary directory and an S3
tier on a local moto endpoint, all real processes started by the supervisor. The
engine: this process, with a KV cache far smaller than the working set, replaying
multi-turn conversations (built in, or a Mooncake trace with `--trace`). For each
request it looks up the prefix (waiting while blocks are promoted from disk or
S3), loads the hits into its KV cache, "recomputes" the rest, stores every block
and finishes the request. Every block it loads is checked against the bytes
derived from its key: end-to-end integrity, mismatches must be 0.

    tierkv demo                 # about a minute; report table, JSON and PNG in ./tierkv-demo
    tierkv demo --quick         # a short run (the test suite runs this)
    tierkv demo --trace conversation_trace.jsonl --requests 2000
    tierkv demo --engine vllm   # then a real vLLM engine (CPU) through the same node

With `--engine vllm` the report adds a real engine's run (`tierkv.demo.vllm_demo`):
time to first token with and without tierkv hits, and whether every output is the
same, token for token, as an engine's without offloading.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tierkv.client import Client
from tierkv.demo.engine import Engine, Totals
from tierkv.demo.report import SAMPLE_EVERY, build_report, plot, render
from tierkv.demo.windows import Snapshot, Windows
from tierkv.node.config import Config, ConfigError, config_from_dict, load_config
from tierkv.node.lifecycle import ChildFailed
from tierkv.node.logs import setup_logging
from tierkv.node.supervisor import EMBEDDED, Node
from tierkv.workloads.traces import Request, read_trace

PAGE = 64 * 1024
GPU_BLOCKS = 512  # the engine's KV cache: far smaller than the working set


def embedded_config(tmp: Path, quick: bool) -> Config:
    """The default node: small tiers, so that a minute of traffic reaches all three."""
    (tmp / "disk").mkdir(exist_ok=True)
    return config_from_dict({
        "instance": f"demo{os.getpid()}",
        "namespace": "demo-model/fp16",
        "run_dir": str(tmp / "run"),
        "log_level": "warning",
        "cpu": {"num_blocks": 320 if quick else 448, "page_size": PAGE},
        "broker": {"heartbeat_s": 1.0, "job_timeout_s": 30.0},
        "worker": {"device": "auto"},
        "tiers": [
            {"type": "disk", "name": "disk", "root": str(tmp / "disk"),
             "budget_bytes": (480 if quick else 1200) * (PAGE + 4096), "threads": 8},
            {"type": "s3", "name": "s3", "endpoint_url": EMBEDDED, "bucket": "tierkv-demo",
             "threads": 8, "negative_ttl_s": 5.0},
        ],
    }, "<embedded demo config>")


def demo_workload(n: int, seed: int) -> list[Request]:
    from tierkv.workloads.synthetic import generate_conversations

    return generate_conversations(
        n, seed=seed, conversations=20, turns=6.0, system_prompts=3, system_prompt_blocks=2,
        documents=16, document_share=0.6, document_blocks=(6, 20), first_blocks=(2, 6),
        turn_blocks=(1, 3), answer_blocks=(1, 2),
    )


# -- the run --------------------------------------------------------------------------


def run(config: Config, requests: list[Request], progress: bool,
        speedup: float, engine_work: Path | None = None, quick: bool = False
        ) -> dict[str, Any]:
    """The demo on `config`'s node; with `engine_work`, then a real vLLM engine through
    the same node (`tierkv.demo.vllm_demo`), its files under that directory."""
    from tqdm import tqdm

    node = Node(config)
    try:
        node.start()
    except ChildFailed:
        raise SystemExit("tierkv demo: the node did not start (why: above)") from None
    engine = None
    try:
        client = Client.from_config(config)
        engine = Engine(config, client, GPU_BLOCKS)
        totals = engine.totals
        start = time.perf_counter()
        windows = Windows(SAMPLE_EVERY, Snapshot.of(totals, 0.0))
        bar = tqdm(total=len(requests), unit="req", disable=not progress, dynamic_ncols=True,
                   desc="tierkv demo")

        def tick(n: int) -> None:
            bar.update(n)
            point = windows.update(totals, time.perf_counter() - start)
            if point is not None:
                bar.set_postfix_str(_postfix(point, totals), refresh=False)

        engine.run(requests, tick, speedup)
        elapsed = time.perf_counter() - start
        windows.update(totals, elapsed, final=True)
        bar.close()
        stats = client.stats()
        client.close()
        report = build_report(config, totals, stats, windows.points, elapsed)
        if engine_work is not None:
            from tierkv.demo.vllm_demo import run_engine

            report["engine"] = run_engine(node.config_path, engine_work, quick,
                                          say=lambda line: print(line, file=sys.stderr))
        return report
    finally:
        if engine is not None:
            engine.close()
        node.stop()


def _postfix(point: dict[str, Any], t: Totals) -> str:
    ratios = " ".join(f"{n} {r:.0%}" for n, r in point["served"].items())
    return f"served {ratios} | {point['gbps']:.2f} GB/s | bad {t.mismatches}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierkv demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (~150 requests)")
    parser.add_argument("--requests", type=int, help="how many requests (default 900)")
    parser.add_argument("--trace", type=Path, help="a Mooncake-format trace to replay")
    parser.add_argument("-c", "--config", help="a node config instead of the embedded one")
    parser.add_argument("--out", type=Path, default=Path("tierkv-demo"),
                        help="where report.json and hit_ratio.png go (default ./tierkv-demo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speedup", type=float,
                        help="replay arrival times this much faster (default 15; 10 for a trace)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--engine", choices=["vllm"],
                        help="then drive a real vLLM engine (its CPU build, in .venv-engine, "
                             "built the first time) through the same node: time to first "
                             "token with and without tierkv hits, and output identity")
    args = parser.parse_args(argv)
    setup_logging("demo", "warning")
    n = args.requests or (150 if args.quick else 900)
    if n < 1:
        parser.error("--requests must be positive")
    try:
        requests = read_trace(args.trace, limit=n) if args.trace else demo_workload(n, args.seed)
    except (OSError, ValueError) as e:
        print(f"tierkv demo: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tierkv-demo-") as tmp:
        try:
            config = load_config(args.config) if args.config else embedded_config(
                Path(tmp), args.quick)
        except ConfigError as e:
            print(f"tierkv demo: {e}", file=sys.stderr)
            return 2
        speedup = args.speedup or (10.0 if args.trace else 15.0)
        engine_work = None
        if args.engine:
            from tierkv.demo.vllm_demo import page_size

            if (config.cpu.page_size, config.cpu.world_size) != (page_size(), 1):
                print(f"tierkv demo: --engine vllm needs cpu.page_size = {page_size()} and "
                      f"cpu.world_size = 1 (its model's KV block); the config has "
                      f"{config.cpu.page_size} and {config.cpu.world_size}", file=sys.stderr)
                return 2
            engine_work = Path(tmp) / "engine"
            engine_work.mkdir()
        report = run(config, requests, not args.no_progress and sys.stderr.isatty(), speedup,
                     engine_work, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "hit_ratio.png")
    print(render(report))
    ok = report["integrity"]["mismatches"] == 0 and report["failed_jobs"] == 0
    if "engine" in report:
        from tierkv.demo.vllm_demo import engine_ok, render_engine

        print("\n" + render_engine(report["engine"]))
        ok = ok and engine_ok(report["engine"])
    print(f"\nreport: {args.out / 'report.json'}   plot: {args.out / 'hit_ratio.png'}")
    return 0 if ok else 1


__all__ = ["demo_workload", "embedded_config", "main"]
