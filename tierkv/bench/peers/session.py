"""What the sections of `tierkv bench peers` share: the run's drivers (started on
first use, one process per system), its scratch directory, the record it builds,
and the disk systems every disk row compares.

A comparison is plain JSON (see `rows`): tierkv's result and each peer's, where a
result holds samples, or why it has none (`skipped` when the peer is not there,
`error` when it failed).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.bench.common import Options, Part
from tierkv.bench.peers import env as peer_env
from tierkv.bench.peers.procs import Driver, DriverError

KIB, MIB = 1 << 10, 1 << 20
OP_TIMEOUT_S = 600.0
MODULES = {"tierkv": "tierkv.bench.peers.drivers.tierkv_driver",
           "lmcache": "tierkv.bench.peers.drivers.lmcache_driver",
           "vllm": "tierkv.bench.peers.drivers.vllm_driver"}


@dataclass(frozen=True)
class DiskSystem:
    system: str  # driver
    kind: str  # the driver's disk system
    label: str


def disk_systems(versions: dict[str, str]) -> list[DiskSystem]:
    lm, vl = versions.get("lmcache", "0.5.6"), versions.get("vllm", "0.33.0")
    return [
        DiskSystem("tierkv", "disk", "tierkv disk tier"),
        DiskSystem("lmcache", "disk", f"LMCache {lm} local disk backend"),
        DiskSystem("lmcache", "fs", f"LMCache {lm} fs connector"),
        DiskSystem("vllm", "fs", f"vLLM {vl} fs tier"),
    ]


@dataclass
class Session:
    """The run's drivers (started on first use), its scratch directory and record."""

    part: Part
    opts: Options
    env: peer_env.PeerEnv
    work: Path
    logs: Path
    drivers: dict[str, Driver] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # driver that did not start
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    starts: int = 0

    def skip_reason(self, system: str) -> str | None:
        if system == "tierkv":
            return self.failed.get(system)
        if not self.env.usable(system):
            return self.env.skipped.get(system, "not installed")
        return self.failed.get(system)

    def start(self, system: str) -> Driver:
        python = sys.executable if system == "tierkv" else self.env.python
        self.starts += 1
        return Driver(system, python, MODULES[system], self.env.process_env(),
                      self.logs / f"{self.starts:02d}-{system}.log")

    def driver(self, system: str) -> Driver | None:
        """The running driver of `system`, or None (with the reason recorded). A
        driver that died is started again: one crash costs its own rows only."""
        if self.skip_reason(system):
            return None
        running = self.drivers.get(system)
        if running is not None and running.proc.poll() is not None:
            self.part.note(f"{system} driver exited ({running.proc.returncode}): restarting it")
            running.close()
            del self.drivers[system]
        if system not in self.drivers:
            try:
                self.drivers[system] = self.start(system)
            except DriverError as e:
                self.failed[system] = f"driver did not start: {e}"
                self.part.note(f"{system}: {self.failed[system]}")
                return None
        return self.drivers[system]

    def close(self) -> None:
        for drv in self.drivers.values():
            drv.close()
        self.drivers.clear()

    def fresh_dir(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path


def result(label: str, samples: list[float] | None = None, *, key: str = "",
           skipped: str | None = None, error: str | None = None, note: str = "",
           headline: bool = True) -> dict[str, Any]:
    return {"label": label, "key": key, "samples": samples, "skipped": skipped,
            "error": error, "note": note, "headline": headline}


def comparison(cid: str, section: str, name: str, unit: str, better: str,
               tierkv: dict[str, Any], peers: list[dict[str, Any]], paired: bool = True,
               headline: bool = True, **extra: Any) -> dict[str, Any]:
    return {"id": cid, "section": section, "name": name, "unit": unit, "better": better,
            "paired": paired, "headline": headline, "tierkv": tierkv, "peers": peers,
            **extra}


