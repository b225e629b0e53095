"""`tierkv status`: a running node's processes and tiers, from the broker's stats
and the supervisor's status file, as a table or as JSON (`report`).

The status file is written when something changes, and its writer may have been
killed since: it records start times, not durations, and each pid with its start
time in clock ticks. So nothing is printed as the file says it: uptimes are
computed now, and a process is called running only if its pid is alive and still
the process that was started (a pid is reused). The table and the JSON are two
renderings of one checked report, stamped `checked_at`; the file's own facts
(restarts, exit codes it saw) say when it was `written`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tierkv.client import BrokerUnavailable, Client
from tierkv.core.shm import process_start_time
from tierkv.node.config import Config

STATUS_FILE = "supervisor.json"


def status_file(config: Config) -> Path:
    return config.run_path / STATUS_FILE


def gather(config: Config, timeout: float = 3.0) -> dict[str, Any]:
    """What the supervisor last wrote and what the broker says now, unchecked."""
    path = status_file(config)
    status: dict[str, Any] = {"instance": config.instance, "broker": None, "supervisor": None,
                              "status_file": str(path)}
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


def report(status: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """`gather`'s answer with every process checked now (`checked_at`): what both
    the table and `tierkv status --json` print."""
    now = time.time() if now is None else now
    sup = status.get("supervisor") or {}
    checked: dict[str, Any] = {
        "instance": status["instance"], "checked_at": now,
        "supervisor": _checked_supervisor(sup, status.get("status_file"), now) if sup else None,
        "processes": _processes(status.get("broker"), sup, now),
        "broker": status.get("broker"),
    }
    if "error" in status:
        checked["error"] = status["error"]
    return checked


def _checked_supervisor(sup: dict[str, Any], path: str | None, now: float) -> dict[str, Any]:
    alive = running(sup.get("pid", 0), sup.get("start_time", 0))
    started = sup.get("started")
    return {
        "pid": sup.get("pid"), "alive": alive, "start_time": sup.get("start_time", 0),
        "started": started, "uptime_s": now - started if alive and started else None,
        "status_file": path, "written": sup.get("written"), "log": sup.get("log"),
        "children": [_checked_child(c, now) for c in sup.get("children", [])],
    }


def _checked_child(child: dict[str, Any], now: float) -> dict[str, Any]:
    alive = running(child["pid"], child.get("start_time", 0))
    started = child.get("started")  # absent in a file an older supervisor wrote
    # An exit code the supervisor saw stays true; one it did not see is unknown.
    code = child.get("exit_code") if not child.get("alive", True) else None
    return {"name": child["name"], "pid": child["pid"],
            "start_time": child.get("start_time", 0), "started": started,
            "alive": alive, "state": "running" if alive else "exited",
            "uptime_s": now - started if alive and started else None,
            "restarts": child.get("restarts", 0), "exit_code": None if alive else code}


def render(status: dict[str, Any], now: float | None = None) -> str:
    checked = report(status, now)
    lines = [f"tierkv node {checked['instance']}"]
    stats = checked["broker"]
    sup = checked["supervisor"]
    lines.append("  " + _supervisor_line(sup))
    if sup and sup.get("log"):
        log = sup["log"]
        lines.append(f"  log: {log['path']} (rotating: {log['files']} files of "
                     f"{_bytes(log['file_bytes'])} at most)")
    if stats is None:
        lines.append(f"  broker: not answering ({checked.get('error', 'unknown')})")
    lines.append("")
    rows = [[p["process"], str(p["pid"]), p["state"],
             _duration(p["uptime_s"]) if p["uptime_s"] is not None else "-",
             str(p["restarts"]) if p["restarts"] is not None else "-"]
            for p in checked["processes"]]
    lines.append(_table(["process", "pid", "state", "uptime", "restarts"], rows))
    lines += [f"  {p['process']} serves {p['endpoint']} (in memory: a restart loses its "
              f"objects, and its tier processes are restarted with it)"
              for p in checked["processes"] if p.get("endpoint")]
    if stats is not None:
        lines.append("")
        lines.append(_table(
            ["tier", "blocks", "bytes", "capacity", "hit ratio", "in flight", "errors",
             "circuit"], _tiers(stats)))
        costs = _load_costs(stats)
        if costs:
            lines.append("")
            lines.append(_table(["tier", "load latency", "bandwidth", "measured",
                                 "slower than recompute"], costs))
    return "\n".join(lines)


def _load_costs(stats: dict[str, Any]) -> list[list[str]]:
    """Each tier's promotion cost as the broker estimates it (`tierkv.core.costs`),
    and the blocks lookups left to recompute because loading them was slower."""
    rows = []
    for name, tier in stats["tiers"].items():
        cost = tier.get("load_cost")
        if cost is None:
            continue
        rows.append([name, f"{cost['latency_ms']:.1f} ms",
                     f"{_bytes(cost['bandwidth_mb_s'] * 1e6)}/s",
                     f"{cost['samples']} promotions" if cost["samples"] else "no (default)",
                     str(tier.get("slower_than_recompute", 0))])
    return rows


def _supervisor_line(sup: dict[str, Any] | None) -> str:
    if not sup:
        return f"supervisor: none (no {STATUS_FILE} in the run directory)"
    if sup["alive"]:
        return f"supervisor: pid {sup['pid']}, up {_duration(sup['uptime_s'] or 0)}"
    return (f"supervisor: pid {sup['pid']} is not running (killed?); what follows is what it "
            f"last wrote, checked now")


def _processes(stats: dict[str, Any] | None, sup: dict[str, Any],
               now: float) -> list[dict[str, Any]]:
    """One row per process: the supervisor's children (checked now), then any peer
    the broker knows that the supervisor did not start."""
    rows: dict[int, dict[str, Any]] = {}
    for child in sup.get("children", []):
        checked = _checked_child(child, now)
        rows[child["pid"]] = {"process": child["name"], "pid": child["pid"],
                              "state": checked["state"], "uptime_s": checked["uptime_s"],
                              "restarts": checked["restarts"], "source": "supervisor"}
        if "endpoint" in child:  # the embedded S3 endpoint: where its tiers reach it
            rows[child["pid"]]["endpoint"] = child["endpoint"]
    if stats is not None:
        broker_pid = next((c["pid"] for c in sup.get("children", []) if c["name"] == "broker"),
                          None)
        if broker_pid is None or broker_pid != stats.get("pid", broker_pid):
            rows[-1] = {"process": "broker", "pid": stats.get("pid", "?"),
                        "state": stats["state"], "uptime_s": stats["uptime_s"],
                        "restarts": None, "source": "broker"}
        else:
            rows[broker_pid]["state"] = stats["state"]
        for peer in stats["peers"]:
            state = peer["state"]
            if peer.get("pinned") is not None:  # a CUDA worker: is its DMA asynchronous?
                state += ", pinned" if peer["pinned"] else ", NOT pinned"
            row = rows.get(peer["pid"])
            if row is None:
                rows[peer["pid"]] = {"process": f"{peer['kind']}:{peer['name']}",
                                     "pid": peer["pid"], "state": state,
                                     "uptime_s": peer["uptime_s"], "restarts": None,
                                     "source": "broker"}
            else:
                row["state"] = state
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
