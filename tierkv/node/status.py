"""`tierkv status`: a table of a running node, from the broker's stats and the
supervisor's status file.

The status file is written when something changes, and its writer may have been
killed since: it records start times, not durations, and each pid with its start
time in clock ticks. So uptimes are computed now, and a process is called running
only if its pid is alive and still the process that was started (a pid is reused).
"""

from __future__ import annotations

import json
import time
from typing import Any

from tierkv.client import BrokerUnavailable, Client
from tierkv.core.shm import process_start_time
from tierkv.node.config import Config


def gather(config: Config, timeout: float = 3.0) -> dict[str, Any]:
    status: dict[str, Any] = {"instance": config.instance, "broker": None, "supervisor": None}
    path = config.run_path / "supervisor.json"
    if path.exists():
        try:
            status["supervisor"] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    try:
        with Client(config.connect_address("client"), timeout=timeout,
                    curve=config.client.curve_keys()) as client:
            status["broker"] = client.stats()
    except BrokerUnavailable as e:
        status["error"] = str(e)
    return status


def running(pid: int, start_time: int) -> bool:
    """`pid` is alive, not a zombie, and the process that started at `start_time`
    (clock ticks since boot; 0: unknown, the pid alone decides)."""
    started = process_start_time(pid)
    if started is None or _zombie(pid):
        return False
    return start_time == 0 or started == 0 or started == start_time


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def render(status: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"tierkv node {status['instance']}"]
    stats = status.get("broker")
    sup = status.get("supervisor") or {}
    lines.append("  " + _supervisor_line(sup, now))
    if sup.get("log"):
        log = sup["log"]
        lines.append(f"  log: {log['path']} (rotating: {log['files']} files of "
                     f"{_bytes(log['file_bytes'])} at most)")
    if stats is None:
        lines.append(f"  broker: not answering ({status.get('error', 'unknown')})")
    lines.append("")
    lines.append(_table(["process", "pid", "state", "uptime", "restarts"],
                        _processes(stats, sup, now)))
    if stats is not None:
        lines.append("")
        lines.append(_table(
            ["tier", "blocks", "bytes", "capacity", "hit ratio", "in flight", "errors",
             "circuit"], _tiers(stats)))
    return "\n".join(lines)


def _supervisor_line(sup: dict[str, Any], now: float) -> str:
    if not sup:
        return "supervisor: none (no supervisor.json in the run directory)"
    pid = sup.get("pid", 0)
    if running(pid, sup.get("start_time", 0)):
        return f"supervisor: pid {pid}, up {_duration(now - sup.get('started', now))}"
    return (f"supervisor: pid {pid} is not running (killed?); what follows is what it "
            f"last wrote, checked now")


def _processes(stats: dict[str, Any] | None, sup: dict[str, Any],
               now: float) -> list[list[str]]:
    rows: dict[int, list[str]] = {}
    for child in sup.get("children", []):
        alive = running(child["pid"], child.get("start_time", 0))
        started = child.get("started")  # absent in a file an older supervisor wrote
        rows[child["pid"]] = [child["name"], str(child["pid"]),
                              "running" if alive else "exited",
                              _duration(now - started) if alive and started else "-",
                              str(child.get("restarts", 0))]
    if stats is not None:
        broker_pid = next((c["pid"] for c in sup.get("children", []) if c["name"] == "broker"),
                          None)
        if broker_pid is None or broker_pid != stats.get("pid", broker_pid):
            rows[-1] = ["broker", str(stats.get("pid", "?")), stats["state"],
                        _duration(stats["uptime_s"]), "-"]
        else:
            rows[broker_pid][2] = stats["state"]
        for peer in stats["peers"]:
            name = f"{peer['kind']}:{peer['name']}"
            state = peer["state"]
            if peer.get("pinned") is not None:  # a CUDA worker: is its DMA asynchronous?
                state += ", pinned" if peer["pinned"] else ", NOT pinned"
            row = rows.get(peer["pid"])
            if row is None:
                rows[peer["pid"]] = [name, str(peer["pid"]), state,
                                     _duration(peer["uptime_s"]), "-"]
            else:
                row[2] = state
    return list(rows.values())


def _tiers(stats: dict[str, Any]) -> list[list[str]]:
    cpu = stats["cpu"]
    looked = cpu["hits"] + cpu["misses"]
    rows = [["cpu", str(cpu["blocks_ready"]), "-", str(cpu["num_blocks"]) + " blocks",
             _ratio(cpu["hits"], looked), str(stats["transfers_in_flight"]),
             str(stats["broker"]["transfers_failed"]), "-"]]
    for name, tier in stats["tiers"].items():
        backend = (tier.get("backend") or [{}])[0]
        capacity = tier.get("capacity_bytes")
        errors = sum(tier.get("failures", {}).values())
        rows.append([
            name, str(tier["blocks"]), _bytes(backend.get("bytes_used")),
            _bytes(capacity) if capacity else "unbounded",
            _ratio(tier.get("promoted_blocks", 0), looked),
            str(tier["in_flight"]), str(errors),
            str(backend.get("circuit", backend.get("breaker", "-"))),
        ])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _ratio(n: float, d: float) -> str:
    return f"{n / d:.3f}" if d else "-"


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
