"""`tierkv status`: a table of a running node, from the broker's stats and the
supervisor's status file."""

from __future__ import annotations

import json
from typing import Any

from tierkv.client import BrokerUnavailable, Client
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


def render(status: dict[str, Any]) -> str:
    lines = [f"tierkv node {status['instance']}"]
    stats = status.get("broker")
    sup = status.get("supervisor") or {}
    if stats is None:
        lines.append(f"  broker: not answering ({status.get('error', 'unknown')})")
    lines.append("")
    lines.append(_table(["process", "pid", "state", "uptime", "restarts"], _processes(stats, sup)))
    if stats is not None:
        lines.append("")
        lines.append(_table(
            ["tier", "blocks", "bytes", "capacity", "hit ratio", "in flight", "errors",
             "circuit"], _tiers(stats)))
    return "\n".join(lines)


def _processes(stats: dict[str, Any] | None, sup: dict[str, Any]) -> list[list[str]]:
    rows: dict[int, list[str]] = {}
    for child in sup.get("children", []):
        rows[child["pid"]] = [child["name"], str(child["pid"]),
                              "running" if child["alive"] else "exited",
                              _duration(child["uptime_s"]), str(child["restarts"])]
    if stats is not None:
        broker_pid = next((c["pid"] for c in sup.get("children", []) if c["name"] == "broker"),
                          None)
        if broker_pid is None:
            rows[-1] = ["broker", "?", stats["state"], _duration(stats["uptime_s"]), "-"]
        else:
            rows[broker_pid][2] = stats["state"]
        for peer in stats["peers"]:
            name = f"{peer['kind']}:{peer['name']}"
            row = rows.get(peer["pid"])
            if row is None:
                rows[peer["pid"]] = [name, str(peer["pid"]), peer["state"],
                                     _duration(peer["uptime_s"]), "-"]
            else:
                row[2] = peer["state"]
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
