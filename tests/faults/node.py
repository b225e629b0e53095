"""The node under fault: configs for a supervised node and the `tierkv up` process
that runs it (faults are real signals to real processes, and only a supervisor
restarts what dies), and what its disk tier really holds (read from the slabs)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integration.cluster import key_bytes, make_config
from tierkv.core.blockformat import HEADER_SIZE, CorruptBlock, unpack_header, verify
from tierkv.core.shm import process_start_time
from tierkv.node.config import Config, dump_config, tier_name
from workers.disk import HEADER_AREA, namespace_dir, namespace_tag, slot_bytes_for

REPO = Path(__file__).resolve().parents[2]
PAGE = 1024  # LAYOUT's block: 2 layers x K/V x 4 tokens x 2 heads x 16 dims x fp16


def seed_from_env() -> int:
    """TIERKV_FAULT_SEED replays a run; otherwise a fresh seed (printed by the tests)."""
    value = os.environ.get("TIERKV_FAULT_SEED")
    return int(value) if value else random.SystemRandom().randrange(2**31)


# -- configs -------------------------------------------------------------------------------


def fault_config(instance: str, run_dir: Path, tiers: list[dict[str, Any]],
                 **sections: Any) -> Config:
    """Heartbeats of 0.5 s, job deadlines of 3 s and broker probes of 1 s, so a fault
    is detected in seconds; a short restart backoff, so recovery is measured, not
    waited for."""
    base: dict[str, Any] = {
        "cpu": {"num_blocks": 48, "page_size": PAGE},
        "broker": {"heartbeat_s": 0.5, "job_timeout_s": 3.0, "tick_ms": 2.0,
                   "drain_timeout_s": 2.0, "events_address": f"ipc://{run_dir / 'events.sock'}"},
        "client": {"timeout_s": 3.0},
        "supervisor": {"ready_timeout_s": 60.0, "stop_timeout_s": 15.0,
                       "restart_backoff_s": 0.2, "restart_backoff_max_s": 2.0,
                       "broker_probe_s": 1.0, "broker_probe_misses": 3},
    }
    for name, value in sections.items():
        base[name] = {**base.get(name, {}), **value} if isinstance(value, dict) else value
    return make_config(instance, run_dir, tiers=tiers, **base)


def disk_tier(root: Path, slots: int, **options: Any) -> dict[str, Any]:
    return {"type": "disk", "name": "disk", "root": str(root),
            "budget_bytes": slots * slot_bytes_for(PAGE), "threads": 2, **options}


def s3_tier(endpoint_url: str, bucket: str, **options: Any) -> dict[str, Any]:
    """Fast-failing S3 settings: a dead endpoint costs one connect timeout, then the
    breaker fails jobs at once until its cool-down passes."""
    return {"type": "s3", "name": "s3", "bucket": bucket, "endpoint_url": endpoint_url,
            "create_bucket": True, "threads": 2, "max_attempts": 2, "connect_timeout_s": 1.0,
            "read_timeout_s": 2.0, "exists_timeout_s": 1.0, "negative_ttl_s": 0.5,
            "breaker_failures": 3, "breaker_cooldown_s": 1.0, **options}


# -- the supervised node -------------------------------------------------------------------


def _state(pid: int) -> str | None:
    """The process state letter (R, S, T, Z...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")


class SupervisedNode:
    """`tierkv up -c FILE` as a subprocess, watched through its status file. Every
    child pid it ever reports is remembered (with its start time) so teardown can
    kill by pid whatever a killed supervisor left behind."""

    def __init__(self, config: Config, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.workdir = workdir
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log_path = workdir / "supervisor.log"
        self.status_path = config.run_path / "supervisor.json"
        self._seen: dict[int, int] = {}  # child pid -> its start time
        self._stopped: set[int] = set()  # pids we SIGSTOPped: continued at teardown

    @property
    def names(self) -> set[str]:
        names = {"broker", *(f"worker{r}" for r in range(self.config.cpu.world_size))}
        for entry in self.config.tiers:
            names.update(f"tier:{tier_name(entry)}:{i}"
                         for i in range(int(entry.get("processes", 1))))
        return names

    def start(self, timeout: float = 90.0) -> dict[str, Any]:
        self.starts += 1
        path = self.workdir / f"node-{self.starts}.toml"
        path.write_text(dump_config(self.config))
        env = {**os.environ, **self.env, "PYTHONPATH": str(REPO)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)], cwd=REPO, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        return self.wait_status(self.all_alive, timeout)

    def status(self) -> dict[str, Any] | None:
        """The running supervisor's status, None before it wrote one."""
        try:
            status = json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return None
        if self.proc is None or status.get("pid") != self.proc.pid:
            return None
        for child in status["children"]:
            if child["pid"] not in self._seen:
                self._seen[child["pid"]] = process_start_time(child["pid"]) or 0
        return status

    def wait_status(self, predicate: Callable[[dict[str, Any]], bool],
                    timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the supervisor exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            status = self.status()
            if status is not None and predicate(status):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"supervisor status not as expected within {timeout}s: "
                                   f"{status}\n{self.log_tail()}")
            time.sleep(0.05)

    def all_alive(self, status: dict[str, Any]) -> bool:
        return {c["name"] for c in status["children"] if c["alive"]} >= self.names

    def pids(self) -> dict[str, int]:
        status = self.status()
        return {} if status is None else {c["name"]: c["pid"] for c in status["children"]}

    def pid(self, name: str) -> int:
        status = self.status()
        assert status is not None, "no supervisor status"
        return next(c["pid"] for c in status["children"] if c["name"] == name)

    def child_down(self, name: str, old_pid: int) -> bool:
        """The supervisor noticed that `old_pid` died (or already replaced it)."""
        status = self.status()
        return status is not None and any(
            c["name"] == name and (c["pid"] != old_pid or not c["alive"])
            for c in status["children"])

    def child_restarted(self, name: str, old_pid: int) -> bool:
        status = self.status()
        return status is not None and any(
            c["name"] == name and c["pid"] != old_pid and c["alive"] for c in status["children"])

    def send(self, pid: int, sig: int) -> None:
        if sig == signal.SIGSTOP:
            self._stopped.add(pid)
        elif sig == signal.SIGCONT:
            self._stopped.discard(pid)
        os.kill(pid, sig)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def children_gone(self) -> bool:
        return all(gone(pid) for pid in self._seen)

    def stop(self) -> int | None:
        """SIGTERM the supervisor (it stops its children), then kill by pid whatever is
        still alive, and sweep what a killed node left in /dev/shm and the run dir."""
        for pid in list(self._stopped):
            with contextlib.suppress(OSError):
                self.send(pid, signal.SIGCONT)
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(10)
        for pid, started in self._seen.items():
            if not gone(pid) and process_start_time(pid) == started:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while not self.children_gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        from tierkv.node.supervisor import Node

        Node(self.config).cleanup()  # a no-op after a clean stop
        return code


# -- disk truth ----------------------------------------------------------------------------


def keys_on_disk(root: Path, namespace: str, block_bytes: int = PAGE) -> tuple[set[bytes], int]:
    """Keys whose block lies whole on disk (header and payload verify), found the way a
    restarted disk tier finds them; and how many of those hold bytes other than
    their key's."""
    slot = slot_bytes_for(block_bytes)
    ns = namespace_tag(namespace)
    found: set[bytes] = set()
    wrong = 0
    for slab in sorted((root / namespace_dir(namespace)).glob("slab-*.dat")):
        raw = slab.read_bytes()
        for offset in range(0, len(raw) - slot + 1, slot):
            payload = raw[offset + HEADER_AREA : offset + HEADER_AREA + block_bytes]
            try:
                header = unpack_header(raw[offset : offset + HEADER_SIZE])
                verify(header, header.key, ns, payload)
            except CorruptBlock:
                continue  # free, torn or zeroed: a restart would not serve it either
            found.add(header.key)
            wrong += payload != key_bytes(header.key, 0, block_bytes)
    return found, wrong
