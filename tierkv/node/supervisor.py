"""A whole node from one config: the broker, a gpu worker per rank, the tier processes.

`Node` owns the lifetimes (CONVENTIONS: the supervisor owns lifetimes). `prepare`
first claims the instance and checks what needs this machine (`preflight`): a
refused start writes and removes nothing. Then it opens the node's log (node.log,
rotating), sweeps what a killed earlier run left, writes the config the children
read, starts the broker and waits for it, then the workers and tiers, polling
every child's readiness pipe and exit together so a crash at start fails fast with
the child's name, exit code and last lines. Each child holds a lifeline to this
process and stops by itself if it dies. `stop` ends the broker first (it drains
in-flight jobs while its peers still serve), then the rest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierkv.core.shm import process_start_time, region_name, remove_stale_region
from tierkv.node.children import TOKEN_SECRET, ChildRegistry
from tierkv.node.config import Config, ConfigError, dump_config, tier_name
from tierkv.node.deaths import describe_exit, likely_cause
from tierkv.node.embedded import (
    EMBEDDED,
    EMBEDDED_KEY_ENV,
    EMBEDDED_SECRET_ENV,
    ENDPOINT,
    embedded_entry,
    endpoint_child,
    endpoint_env,
    start_endpoint,
    users,
    wants_endpoint,
)
from tierkv.node.lifecycle import (
    Child,
    ChildFailed,
    child_environment,
    spawn,
    stop,
    wait_ready,
)
from tierkv.node.logs import NodeLog
from tierkv.node.preflight import AlreadyRunning, InstanceClaim, check_here, check_no_live_region
from tierkv.node.probe import BrokerProbe
from tierkv.node.s3server import S3ServerError
from tierkv.wire.sockets import RunDirError, ensure_run_dir, ipc_path

log = logging.getLogger("tierkv.node.supervisor")

@dataclass(frozen=True)
class ChildSpec:
    name: str  # "broker", "worker0", "tier:disk:0"
    kind: str  # "broker" | "worker" | "tier"
    argv: tuple[str, ...]


class Node:
    def __init__(self, config: Config, python: str = sys.executable, echo: bool = False,
                 verbose: int = 0) -> None:
        self.config = config
        self.python = python
        self.echo = echo
        self.verbose = verbose
        self.children: dict[str, Child] = {}
        self.restarts: dict[str, int] = {}
        self.started: dict[str, tuple[float, int]] = {}  # name -> (epoch, start ticks)
        self.config_path = config.run_path / "node.toml"
        self.log_path = config.run_path / "node.log"
        self.s3: Any = None  # the embedded S3 endpoint, when a tier asks for one
        self._child_env: dict[str, str] = {}
        self.registry = ChildRegistry(config.run_path)  # what the broker may fence
        self._claim = InstanceClaim(config.run_path)
        self._log: NodeLog | None = None

    # -- what runs -------------------------------------------------------------------

    def specs(self) -> list[ChildSpec]:
        c = ["-c", str(self.config_path)] + ["-v"] * self.verbose
        py = self.python
        specs = [ChildSpec("broker", "broker", (py, "-m", "broker", *c))]
        for rank in range(self.config.cpu.world_size if self.config.worker.enabled else 0):
            specs.append(ChildSpec(f"worker{rank}", "worker",
                                   (py, "-m", "workers.gpu_worker", "--rank", str(rank), *c)))
        for entry in self.config.tiers:
            name = tier_name(entry)
            for i in range(int(entry.get("processes", 1))):
                specs.append(ChildSpec(f"tier:{name}:{i}", "tier",
                                       (py, "-m", "workers.tier_worker", "--name", name, *c)))
        return specs

    # -- lifetime --------------------------------------------------------------------

    def prepare(self) -> None:
        """Claim the instance and check this machine, then open the log and sweep an
        earlier run's leftovers. Raises AlreadyRunning or ConfigError having changed
        nothing of a running node. Idempotent."""
        if self._claim.held:
            return
        try:
            ensure_run_dir(self.config.run_path)
        except RunDirError as e:
            raise ConfigError(f"{self.config.source}: {e}") from None
        self._claim.acquire(self.config.instance)
        try:
            check_no_live_region(self.config.instance)
            check_here(self.config)
            sup = self.config.supervisor
            self._log = NodeLog(self.log_path, sup.log_file_bytes, sup.log_file_count).attach()
            self.cleanup("an earlier run of this instance")
        except BaseException:
            self._release()
            raise

    def start(self) -> None:
        self.prepare()
        try:
            self.config_path.write_text(dump_config(self._child_config()))
            os.chmod(self.config_path, 0o600)
            timeout = self.config.supervisor.ready_timeout_s
            specs = self.specs()
            self._start([s for s in specs if s.kind == "broker"], timeout)
            self._start([s for s in specs if s.kind != "broker"], timeout)
        except BaseException as e:
            if isinstance(e, ChildFailed):  # said while the node's log is open
                log.error("node %s did not start: %s", self.config.instance, e)
            self.stop()
            raise

    def _child_config(self) -> Config:
        """The config the children read: an `endpoint_url = "embedded"` S3 tier gets
        a local moto endpoint that this node starts, supervises (`ENDPOINT`) and
        stops, which admits only the node's own key pair: a new random one, in the
        tier processes' environment (readable by this user only) under names the
        rewritten entry gives."""
        if not wants_endpoint(self.config):
            return self.config
        if self.s3 is None:
            self._adopt_endpoint(start_endpoint(self.config, self._sink()))
        tiers = [embedded_entry(t, self.s3.endpoint_url)
                 if t.get("endpoint_url") == EMBEDDED else t for t in self.config.tiers]
        return dataclasses.replace(self.config, tiers=tiers)

    def restart_endpoint(self) -> Child:
        """The embedded endpoint, started again after it died: same port and keys,
        nothing of what it held. Raises S3ServerError when it does not start."""
        self._adopt_endpoint(start_endpoint(self.config, self._sink(), previous=self.s3))
        return self.children[ENDPOINT]

    def _adopt_endpoint(self, server: Any) -> None:
        self.s3 = server
        self._child_env.update(endpoint_env(server))
        child = endpoint_child(server)
        self.children[ENDPOINT] = child
        self.started[ENDPOINT] = (time.time(), process_start_time(child.pid) or 0)

    @property
    def endpoint_running(self) -> bool:
        """False while the embedded endpoint is down (True for a node without one)."""
        return self.s3 is None or self.s3.running

    def endpoint_users(self) -> set[str]:
        return users(self.config)

    def _start(self, specs: list[ChildSpec], timeout: float) -> None:
        started = [self.spawn(spec) for spec in specs]
        wait_ready(started, timeout)
        for child in started:
            log.info("%s ready (pid %d)", child.name, child.pid)

    def spawn(self, spec: ChildSpec) -> Child:
        previous = self.children.get(spec.name)
        if previous is not None:
            self.registry.remove_pid(previous.pid)
        # A token for each peer that says hello (the broker says it to no one),
        # recorded before the child can read it: its hello always finds the record.
        token = ChildRegistry.new_token() if spec.kind != "broker" else ""
        child = spawn(spec.name, spec.argv, env=child_environment(self._child_env),
                      log_lines=self.config.supervisor.log_lines, echo=self.echo,
                      sink=self._sink(), secrets={TOKEN_SECRET: token} if token else None,
                      on_started=(lambda pid: self.registry.add(token, spec.name, pid))
                      if token else None)
        self.children[spec.name] = child
        self.started[spec.name] = (time.time(), process_start_time(child.pid) or 0)
        return child

    def _sink(self) -> Any:
        return self._log.write_line if self._log is not None else None

    def stop(self) -> dict[str, int | None]:
        """Broker first, then everyone else; each within the stop timeout. Idempotent."""
        if not self._claim.held:
            return {}
        timeout = self.config.supervisor.stop_timeout_s
        codes: dict[str, int | None] = {}
        order = sorted(self.children.values(), key=lambda c: c.name != "broker")
        for child in order:
            if child.name == "broker":
                codes[child.name] = stop(child, timeout)
        # The embedded endpoint last: its tier processes may still be writing to it.
        others = [c for c in order if c.name not in ("broker", ENDPOINT)]
        for child in others:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in others:
            codes[child.name] = stop(child, max(0.1, deadline - time.monotonic()), sig=None)
        self.children.clear()
        self.registry.clear()
        if self.s3 is not None:
            codes[ENDPOINT] = self.s3.stop()
            self.s3 = None
        self.cleanup()
        bad = {name: code for name, code in codes.items() if code not in (0, None)}
        if bad:
            log.warning("processes exited with %s", bad)
        log.info("node %s stopped", self.config.instance)
        self._release()
        return codes

    def _release(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        self._claim.release()

    def cleanup(self, left_by: str = "") -> list[str]:
        """Remove this instance's region if its owner is dead, and socket files no
        live broker serves. Returns what was removed; says so when `left_by` names
        whose leftovers they were (an earlier run's; after our own stop, what our
        children left is not news)."""
        from tierkv.engine import sweep_stale_kv_segments

        removed = sweep_stale_kv_segments(self.config.instance)
        name = region_name(self.config.instance)
        if os.path.exists(f"/dev/shm{name}"):
            remove_stale_region(self.config.instance)
            if not os.path.exists(f"/dev/shm{name}"):
                removed.append(name)
        if not os.path.exists(f"/dev/shm{name}"):  # no live broker of this instance
            for link in ("client", "worker", "tier"):
                path = ipc_path(self.config.address(link))
                if path is not None and path.exists():
                    path.unlink()
                    removed.append(str(path))
            for leftover in (self.config_path,):
                if leftover.exists():
                    leftover.unlink()
        if removed:
            if left_by:
                log.info("removed what %s left: %s", left_by, ", ".join(removed))
            else:
                log.debug("removed after the stop: %s", ", ".join(removed))
        return removed

    def pid(self, name: str) -> int:
        return self.children[name].pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.children[name].pid, sig)

    @property
    def log_file(self) -> dict[str, Any]:
        sup = self.config.supervisor
        return {"path": str(self.log_path), "file_bytes": sup.log_file_bytes,
                "files": sup.log_file_count}

    def __enter__(self) -> Node:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Supervisor:
    """Runs a `Node` until SIGINT/SIGTERM: restarts a child that dies with capped
    exponential backoff (the broker re-admits it, a disk tier recovers its
    inventory) and keeps a status file for `tierkv status`."""

    STABLE_S = 30.0  # a child up this long has its backoff reset

    def __init__(self, node: Node, on_ready: Callable[[], None] | None = None) -> None:
        """`on_ready` runs once the whole node is up (`tierkv up --detach` is told)."""
        self.node = node
        self.on_ready = on_ready
        self.config = node.config
        self.stopping = False
        self.status_path = node.config.run_path / "supervisor.json"
        self.started: tuple[float, int] = (0.0, 0)  # epoch, start ticks
        self._specs = {spec.name: spec for spec in node.specs()}
        self._backoff: dict[str, float] = {}
        self._due: dict[str, float] = {}  # name -> when to restart it
        self._explained: set[int] = set()  # exit codes whose likely cause was said
        self._asked_to_stop: dict[str, float] = {}  # name -> when to SIGKILL it
        probe = node.config.supervisor
        self.probe = (BrokerProbe(node.config, probe.broker_probe_misses, probe.broker_probe_s)
                      if probe.broker_probe_s > 0 else None)

    def request_stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        try:
            self.node.prepare()  # a refusal here has touched nothing
        except AlreadyRunning as e:
            log.error("%s", e)
            return 1
        except ConfigError as e:
            log.error("%s", e)
            return 2
        self.status_path.unlink(missing_ok=True)  # a killed earlier supervisor's
        self.started = (time.time(), process_start_time(os.getpid()) or 0)
        log.info("node %s starting; its log: %s", self.config.instance, self.node.log_path)
        try:
            self.node.start()
        except ChildFailed:
            return 1  # said by the node, in its log
        log.info("node %s up: %s", self.config.instance,
                 ", ".join(f"{c.name}={c.pid}" for c in self.node.children.values()))
        self._write_status()
        if self.probe is not None:
            self.probe.start()
        try:
            if self.on_ready is not None:
                self.on_ready()
            while not self.stopping:
                self.kill_hung_broker()
                self.watch()
                time.sleep(0.1)
        finally:
            if self.probe is not None:
                self.probe.stop()
            log.info("stopping node %s", self.config.instance)
            self.node.stop()
            self.status_path.unlink(missing_ok=True)
        return 0

    def kill_hung_broker(self) -> None:
        """SIGKILL the broker the probe found hung; `watch` restarts it as after a crash.
        Only our own child, and only the pid that stopped answering."""
        probe = self.probe
        if probe is None or probe.hung_pid is None:
            return
        hung, probe.hung_pid = probe.hung_pid, None
        broker = self.node.children.get("broker")
        if broker is not None and broker.pid == hung and broker.proc.poll() is None:
            log.warning("broker (pid %d) missed %d probes of %.1fs in a row: hung; killing "
                        "it to restart it", hung, probe.misses, probe.interval_s)
            broker.proc.kill()

    def watch(self) -> None:
        """One round: notice deaths, restart what is due."""
        now = time.monotonic()
        self._kill_overdue_stops(now)
        changed = False
        for name, child in list(self.node.children.items()):
            code = child.proc.poll()
            if code is None or name in self._due:
                continue
            self._died(name, child, code, now)
            changed = True
        changed = self._restart_due(now) or changed
        if changed:
            self._write_status()

    def _died(self, name: str, child: Child, code: int, now: float) -> None:
        """Schedule the restart of a child that exited, and say why it will wait."""
        uptime = now - child.started_at
        if self._asked_to_stop.pop(name, None) is not None:
            delay = self.config.supervisor.restart_backoff_s  # no fault of its own
            log.info("%s (pid %d) %s as asked after %.1fs; restarting it in %.1fs, once the "
                     "S3 endpoint answers", name, child.pid, describe_exit(code), uptime, delay)
        else:
            delay = self._next_delay(name, uptime)
            log.warning("%s (pid %d) %s after %.1fs; restarting in %.1fs; its last lines:\n%s",
                        name, child.pid, describe_exit(code), uptime, delay, child.tail(10))
            self._explain(code)
        self._due[name] = now + delay
        child.close_fds()
        if name == ENDPOINT:
            self._stop_endpoint_users(now)

    def _next_delay(self, name: str, uptime: float) -> float:
        """The first delay for a child that had been up a while, else twice the last
        one, up to the configured maximum: a child that keeps dying is no tight loop."""
        sup = self.config.supervisor
        last = self._backoff.get(name, 0.0)
        delay = (sup.restart_backoff_s if uptime > self.STABLE_S or not last
                 else min(last * 2, sup.restart_backoff_max_s))
        self._backoff[name] = delay
        return delay

    def _stop_endpoint_users(self, now: float) -> None:
        """The embedded endpoint died with every object it held: its tier processes
        go too (SIGTERM), so that the broker drops the blocks they reported, and come
        back after it with its new, empty inventory."""
        deadline = now + self.config.supervisor.stop_timeout_s
        for name in sorted(self.node.endpoint_users()):
            child = self.node.children.get(name)
            if child is None or child.proc.poll() is not None:
                continue  # already dead: restarted as any death
            log.warning("stopping %s (pid %d) to restart it: the S3 endpoint it stores in lost "
                        "every object it held", name, child.pid)
            child.proc.send_signal(signal.SIGTERM)
            self._asked_to_stop[name] = deadline

    def _kill_overdue_stops(self, now: float) -> None:
        """SIGKILL a child asked to stop that is still running `stop_timeout_s` later
        (once: its exit is then noticed as any other)."""
        for name, deadline in list(self._asked_to_stop.items()):
            child = self.node.children.get(name)
            if now < deadline or child is None:
                continue
            self._asked_to_stop[name] = float("inf")
            if child.proc.poll() is None:
                log.warning("%s (pid %d) ignored SIGTERM for %.0fs (stop_timeout_s): killing "
                            "it", name, child.pid, self.config.supervisor.stop_timeout_s)
                child.proc.kill()

    def _restart_due(self, now: float) -> bool:
        """Restart each child whose delay has passed; the embedded endpoint before
        the tier processes that use it, which wait while it is down. True if any
        was restarted."""
        changed = False
        waiting_for_endpoint = self.node.endpoint_users()
        for name in sorted(self._due, key=lambda n: n != ENDPOINT):
            if now < self._due[name] or (name in waiting_for_endpoint
                                         and not self.node.endpoint_running):
                continue
            try:
                child = self._restart(name)
            except S3ServerError as e:
                delay = self._next_delay(name, 0.0)
                self._due[name] = time.monotonic() + delay
                log.warning("%s did not start again: %s; next try in %.1fs", name, e, delay)
                continue
            del self._due[name]
            self.node.restarts[name] = self.node.restarts.get(name, 0) + 1
            log.info("restarted %s (pid %d)", name, child.pid)
            changed = True
        return changed

    def _restart(self, name: str) -> Child:
        if name == ENDPOINT:
            return self.node.restart_endpoint()
        return self.node.spawn(self._specs[name])

    def _explain(self, code: int) -> None:
        """Say the likely cause of a death by this signal, once per run: a child in a
        loop of the same death would repeat it at every restart."""
        cause = likely_cause(code, self.config.cpu.prefault)
        if cause is not None and code not in self._explained:
            self._explained.add(code)
            log.warning("%s", cause)

    def _serves(self, name: str) -> dict[str, str]:
        """What a child serves that a reader of the status needs: the URL of the
        embedded S3 endpoint (its port stays the same across restarts)."""
        if name == ENDPOINT and self.node.s3 is not None:
            return {"endpoint": self.node.s3.endpoint_url}
        return {}

    def _write_status(self) -> None:
        """Start times, not durations, and each pid's start time in clock ticks: a
        reader computes uptimes live and checks each pid is still the process it
        names (`tierkv.node.status`), also after this supervisor was killed.
        `alive` is what this supervisor knew when it wrote the file."""
        children = []
        for c in self.node.children.values():
            started, ticks = self.node.started.get(c.name, (0.0, 0))
            code = c.proc.poll()
            children.append({"name": c.name, "pid": c.pid, "start_time": ticks,
                             "started": started, "alive": code is None, "exit_code": code,
                             "restarts": self.node.restarts.get(c.name, 0),
                             **self._serves(c.name)})
        started, ticks = self.started
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({
            "pid": os.getpid(), "start_time": ticks, "started": started,
            "instance": self.config.instance, "written": time.time(),
            "log": self.node.log_file, "children": children}))
        tmp.replace(self.status_path)


__all__ = ["EMBEDDED", "EMBEDDED_KEY_ENV", "EMBEDDED_SECRET_ENV", "ENDPOINT", "ChildFailed",
           "ChildSpec", "Node", "Supervisor"]
