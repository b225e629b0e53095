"""The node an engine that copies its own blocks runs against (the benchmarks' and
the engine tests'), kept free of any engine's imports so that each engine's
environment builds it the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierkv.node.config import Config, config_from_dict


def node_config(instance: str, run_dir: Path, page_size: int, cpu_blocks: int,
                disk_blocks: int = 0, label: str = "<vllm engine node>",
                **sections: Any) -> Config:
    """A tierkv node for engines of `page_size` bytes per GPU block that copy their
    own blocks (vLLM, SGLang): no gpu workers, and a disk tier of `disk_blocks` under
    `run_dir` if that is not 0. `sections` replace or extend the config's own."""
    tiers = []
    if disk_blocks:
        (run_dir / "disk").mkdir(exist_ok=True)
        tiers.append({"type": "disk", "root": str(run_dir / "disk"),
                      "budget_bytes": disk_blocks * page_size})
    data: dict[str, Any] = {
        "instance": instance, "run_dir": str(run_dir), "log_level": "warning",
        "cpu": {"num_blocks": cpu_blocks, "page_size": page_size, "world_size": 1},
        # One engine may hold the whole (small) CPU tier; tests of several engines on
        # one node set their share.
        "broker": {"heartbeat_s": 0.5, "tick_ms": 2.0, "job_timeout_s": 10.0,
                   "owner_share": 1.0},
        "supervisor": {"ready_timeout_s": 30.0, "stop_timeout_s": 10.0},
        "worker": {"enabled": False},
        "tiers": tiers,
    }
    for name, value in sections.items():
        data[name] = {**data[name], **value} if isinstance(data.get(name), dict) else value
    return config_from_dict(data, label)
