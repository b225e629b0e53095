"""A driver process seen from the parent: start it, send a request, wait for the
answer with a deadline, stop it.

Each system runs in its own process (`python -m tierkv.bench.peers.drivers.X`):
the peers with the peers' environment's python, tierkv with tierkv's. The
parent never imports a peer. A driver's stderr (the peers log a lot) goes to a
log file; when a driver dies or misses a deadline, the error names the log and
quotes its last lines.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from pathlib import Path
from typing import Any

import tierkv

REPO = Path(tierkv.__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0  # importing vLLM's scheduler path takes ~10 s on an idle core
STOP_TIMEOUT_S = 30.0


class DriverError(RuntimeError):
    """A request failed inside the driver (its message is the driver's)."""


class Unsupported(DriverError):
    """The system has no such feature; its row says so."""


class DriverDied(DriverError):
    """The driver process ended or stopped answering."""


class Driver:
    """One running driver. Not thread-safe: one caller at a time (the policy
    section drives each driver from its own thread)."""

    def __init__(self, system: str, python: str | Path, module: str, env: dict[str, str],
                 log: Path, start_timeout: float = START_TIMEOUT_S) -> None:
        self.system = system
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(env)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        self._log_file = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(python), "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log_file, env=env, cwd=str(REPO))
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            hello = self._read(start_timeout, "start")
        except BaseException:
            self.close()
            raise
        if not hello.get("ready"):
            self.close()
            raise DriverDied(f"{system} driver said {hello!r} instead of ready")
        self.versions: dict[str, str] = hello.get("versions", {})
        self.pid: int = int(hello.get("pid", self.proc.pid))

    def call(self, op: str, timeout: float, **args: Any) -> Any:
        """Run `op` in the driver; its result, or DriverError / Unsupported."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            raise DriverDied(self._why(f"{op}: cannot write to the driver ({e})")) from e
        reply = self._read(timeout, op)
        if reply.get("ok"):
            return reply.get("result")
        error = str(reply.get("error", "no reason given"))
        raise (Unsupported if reply.get("unsupported") else DriverError)(error)

    def _read(self, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise DriverDied(self._why(f"{what}: no answer within {timeout:.0f} s"))
            if not self._selector.select(min(left, 1.0)):
                continue
            assert self.proc.stdout is not None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
                raise DriverDied(self._why(f"{what}: the driver exited with status "
                                           f"{self.proc.returncode}"))
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _why(self, text: str) -> str:
        return f"{self.system} {text}; last lines of {self.log}: {tail(self.log)}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def close(self) -> None:
        """Ask the driver to quit; kill it (by pid) if it does not in time."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._selector.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log_file.close()

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tail(path: Path, lines: int = 4, skip: str = "") -> str:
    """The last meaningful lines of a log, on one line (lines holding `skip` left
    out: pip's warnings about local indexes, say)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    kept = [line.strip() for line in text if line.strip() and not (skip and skip in line)]
    return " | ".join(kept[-lines:])[-600:] or "(empty)"
