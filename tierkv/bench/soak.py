"""Soak: replay a trace against a full node for a while and watch for slow leaks.

    python -m tierkv.bench.soak                      # 10 minutes, the Mooncake trace if present
    python -m tierkv.bench.soak --duration 120 --out soak.json

The node is the demo's: broker, CPU worker, disk tier (in a temporary directory) and
S3 tier on an embedded moto endpoint, all started by a `tierkv up` supervisor
subprocess, as in production. This process plays the engine (`tierkv.demo.engine.Engine`:
arrival-paced, concurrent, every loaded block checked against its key's bytes) and
replays the trace in chunks until the duration is up, from the start again if the
trace runs out.

Sampled at the start, every `--sample-every` seconds and at the end: resident memory
(VmRSS) and open file descriptors of the supervisor, broker, workers, tier processes
and the moto endpoint; this instance's /dev/shm segments; the error counters of the
broker, the tiers, the supervisor (restarts) and the engine (byte mismatches, failed
jobs). The verdict compares the end with the sample taken after the warm-up (caches,
pools and allocator arenas fill during it):

- RSS of every tierkv process grows by less than 20% (or 8 MiB, whichever is larger:
  an allocator arena of a small process is not a leak); the moto endpoint, a stand-in
  that keeps the bucket in its memory, by less than the S3 tier's budget;
- open descriptors of every process grow by at most 5;
- no new /dev/shm segment of this instance, none allocating more than its size, and
  none left after the stop (a segment's pages are allocated as they are first
  touched, so its usage grows up to its size: not a leak);
- no byte mismatch, failed job, protocol error, failed transfer or tier job, peer
  death or restart. A promotion that finds its key evicted by the tier's own budget
  meanwhile (`not_found`: a miss the engine recomputes) is counted, not judged.
Exit status 0 when every bound holds, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RSS_GROWTH = 0.20
RSS_FLOOR = 8 * 2**20
MOTO = "s3-endpoint (moto)"
FD_GROWTH = 5
PAGE = 32 * 1024
GPU_BLOCKS = 512
S3_BUDGET = 2048 * (PAGE + 256)  # the S3 tier's LRU budget: what moto may hold
WARNING_LINES = 20
CHUNK = 50  # requests per engine run: the duration is checked between chunks
# A promotion that reaches a tier after the tier's own budget evicted the key (the
# eviction is reported in the same completion batch) fails `not_found`: a miss the
# engine recomputes, not an error. Counted and shown, not judged.
RACED = "not_found"
STOP = threading.Event()  # SIGTERM/SIGINT: end the load early, still stop and report
ERROR_COUNTERS = ("mismatches", "failed_jobs", "engine_exceptions", "protocol_errors",
                  "transfers_failed", "tier_jobs_failed", "corrupt_blocks", "peer_deaths",
                  "restarts")


def soak_config(tmp: Path, instance: str) -> Any:
    """The demo's node, sized so a 2-core machine keeps up and every tier fills (and
    then evicts) within the first minutes: steady state is what a soak measures."""
    from tierkv.node.config import config_from_dict
    from tierkv.node.supervisor import EMBEDDED

    (tmp / "disk").mkdir()
    return config_from_dict({
        "instance": instance,
        "namespace": "soak-model/fp16",
        "run_dir": str(tmp / "run"),
        "log_level": "warning",
        "cpu": {"num_blocks": 512, "page_size": PAGE},
        "broker": {"heartbeat_s": 1.0, "job_timeout_s": 30.0},
        "worker": {"device": "cpu"},
        "supervisor": {"ready_timeout_s": 120.0},
        "tiers": [
            {"type": "disk", "name": "disk", "root": str(tmp / "disk"),
             "budget_bytes": 2048 * (PAGE + 4096), "threads": 4},
            {"type": "s3", "name": "s3", "endpoint_url": EMBEDDED, "bucket": "tierkv-soak",
             "threads": 4, "budget_bytes": S3_BUDGET, "negative_ttl_s": 5.0},
        ],
    }, "<soak config>")


# -- the node ------------------------------------------------------------------------------


class SupervisorProc:
    """`tierkv up` as a subprocess; its status file names the children."""

    def __init__(self, config: Any, tmp: Path) -> None:
        from tierkv.node.config import dump_config

        self.config = config
        self.path = tmp / "node.toml"
        self.path.write_text(dump_config(config))
        self.log = tmp / "supervisor.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierkv.cli", "up", "-c", str(self.path)], cwd=REPO,
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        want = {"broker", "worker0", "tier:disk:0", "tier:s3:0"}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"soak: the node did not start:\n{self.tail()}")
            status = self.status()
            if status and {c["name"] for c in status["children"] if c["alive"]} >= want:
                return
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"soak: the node was not ready within {timeout:.0f}s:\n{self.tail()}")

    def status(self) -> dict[str, Any] | None:
        try:
            status = json.loads((self.config.run_path / "supervisor.json").read_text())
        except (OSError, ValueError):
            return None
        return status if self.proc is not None and status.get("pid") == self.proc.pid else None

    def processes(self) -> dict[str, int]:
        """name -> pid: the supervisor, its children, and the moto endpoint (a child
        of the supervisor that is not in its status)."""
        assert self.proc is not None
        status = self.status() or {"children": []}
        found = {"supervisor": self.proc.pid}
        found.update({c["name"]: c["pid"] for c in status["children"] if c["alive"]})
        known = set(found.values())
        for pid in _children_of(self.proc.pid):
            if pid not in known:
                found["s3-endpoint (moto)"] = pid
        return found

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        pids = self.processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        for pid in pids.values():  # by pid, anything a stuck stop left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return code

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _children_of(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            out.append(int(entry))
    return out


# -- samples --------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def shm_usage(instance: str) -> dict[str, int]:
    """This instance's segments: how many, their sizes, the bytes allocated to them."""
    count = size = used = 0
    for entry in os.listdir("/dev/shm"):
        if entry.startswith(f"tierkv.{instance}."):
            try:
                st = os.stat(f"/dev/shm/{entry}")
            except OSError:
                continue
            count += 1
            size += st.st_size
            used += st.st_blocks * 512
    return {"segments": count, "size": size, "bytes": used}


def errors_of(stats: dict[str, Any] | None, status: dict[str, Any] | None,
              totals: Any, exceptions: int) -> dict[str, int]:
    broker = (stats or {}).get("broker", {})
    tiers = (stats or {}).get("tiers", {}).values()
    return {
        "mismatches": totals.mismatches,
        "failed_jobs": totals.failed_jobs,
        "engine_exceptions": exceptions,
        "protocol_errors": int(broker.get("protocol_errors", 0)),
        "request_errors": int(broker.get("request_errors", 0)),  # refused loads: not judged
        "transfers_failed": int(broker.get("transfers_failed", 0)),
        "tier_jobs_failed": sum(n for t in tiers for cause, n in t.get("failures", {}).items()
                                if cause != RACED),
        "tier_loads_raced": sum(int(t.get("failures", {}).get(RACED, 0)) for t in tiers),
        "corrupt_blocks": sum(int(t.get("failures", {}).get("corrupt", 0)) for t in tiers),
        "peer_deaths": int(broker.get("peer_deaths", 0)),
        "restarts": sum(int(c["restarts"]) for c in (status or {}).get("children", [])),
    }


@dataclasses.dataclass
class Sampler:
    node: SupervisorProc
    instance: str
    client: Any
    start: float = dataclasses.field(default_factory=time.monotonic)
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def sample(self, totals: Any, exceptions: int) -> dict[str, Any]:
        from tierkv.client import BrokerUnavailable, RemoteError

        try:
            stats = self.client.stats()
        except (BrokerUnavailable, RemoteError):
            stats = None
        procs = self.node.processes()
        point = {
            "t": round(time.monotonic() - self.start, 1),
            "requests": totals.requests,
            "blocks": totals.blocks,
            "processes": {name: {"pid": pid, "rss": rss_bytes(pid), "fds": fd_count(pid)}
                          for name, pid in procs.items()},
            "engine": {"pid": os.getpid(), "rss": rss_bytes(os.getpid()),
                       "fds": fd_count(os.getpid())},
            "shm": shm_usage(self.instance),
            "errors": errors_of(stats, self.node.status(), totals, exceptions),
            "tiers": {n: {"blocks": t.get("blocks"), "evictions": t.get("evictions"),
                          "failures": t.get("failures", {}),
                          "held_bytes": sum(int(b.get("bytes", b.get("bytes_used", 0)))
                                            for b in t.get("backend", []))}
                      for n, t in (stats or {}).get("tiers", {}).items()},
        }
        self.samples.append(point)
        return point


# -- the run --------------------------------------------------------------------------------


def load_requests(trace: Path | None, seed: int) -> tuple[list[Any], str]:
    from tierkv.demo.command import demo_workload
    from tierkv.workloads.traces import MOONCAKE_TRACE, read_trace

    if trace is not None:
        return read_trace(trace), str(trace)
    if MOONCAKE_TRACE.is_file():
        return read_trace(MOONCAKE_TRACE), str(MOONCAKE_TRACE)
    return demo_workload(3000, seed), "synthetic (tierkv.demo.command.demo_workload)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tierkv.client import Client
    from tierkv.demo.engine import Engine, Totals

    requests, source = load_requests(args.trace, args.seed)
    duration = min(args.duration, args.max_duration)
    warmup = args.warmup if args.warmup is not None else min(120.0, duration / 4)
    instance = f"soak{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="tierkv-soak-") as tmp_name:
        tmp = Path(tmp_name)
        config = soak_config(tmp, instance)
        node = SupervisorProc(config, tmp)
        print(f"soak: {duration:.0f}s (warm-up {warmup:.0f}s) of {source}, "
              f"speedup {args.speedup}", flush=True)
        node.start(config.supervisor.ready_timeout_s)
        client = Client.from_config(config)
        sampler = Sampler(node, instance, Client.from_config(config))
        totals, exceptions, engine = Totals(), 0, None
        warm: dict[str, Any] | None = None
        try:
            engine = Engine(config, client, GPU_BLOCKS)
            sampler.sample(totals, exceptions)
            stop_at = sampler.start + duration
            next_sample = time.monotonic() + args.sample_every
            position = 0
            while time.monotonic() < stop_at and not STOP.is_set():
                chunk = [requests[(position + i) % len(requests)] for i in range(CHUNK)]
                position += CHUNK
                try:
                    engine.run(chunk, lambda n: None, args.speedup)
                except Exception as e:  # counted and judged; the soak goes on
                    exceptions += 1
                    print(f"soak: engine error: {type(e).__name__}: {e}", flush=True)
                    engine.close()
                    engine = Engine(config, client, GPU_BLOCKS)
                    engine.totals = totals
                totals = engine.totals
                now = time.monotonic()
                if warm is None and now - sampler.start >= warmup:
                    warm = sampler.sample(totals, exceptions)
                    next_sample = now + args.sample_every
                elif now >= next_sample:
                    point = sampler.sample(totals, exceptions)
                    next_sample = now + args.sample_every
                    print(_progress(point), flush=True)
            end = sampler.sample(totals, exceptions)
            warm = warm or sampler.samples[0]
        finally:
            if engine is not None:
                engine.close()
            client.close()
            sampler.client.close()
            code = node.stop()
        left = shm_usage(instance)["segments"] + len(list(config.run_path.glob("*.sock")))
        elapsed = end["t"]
        return {
            "duration_s": elapsed, "warmup_s": warmup, "trace": source,
            "speedup": args.speedup, "requests": totals.requests, "blocks": totals.blocks,
            "request_rate": totals.requests / max(elapsed, 1e-9),
            "block_rate": totals.blocks / max(elapsed, 1e-9),
            "page_size": PAGE, "samples": sampler.samples,
            "start": sampler.samples[0], "warm": warm, "end": end,
            "supervisor_exit": code, "left_behind": left,
            # What the node warned about (a peer's death and why, a restart): the
            # counters say that something failed, these lines say what.
            "warnings": [line for line in node.log.read_text(errors="replace").splitlines()
                         if " WARNING " in line or " ERROR " in line][-WARNING_LINES:],
            "verdict": verdict(warm, end, code, left),
        }


def _progress(point: dict[str, Any]) -> str:
    rss = sum((p["rss"] or 0) for p in point["processes"].values())
    bad = {k: v for k, v in point["errors"].items() if v and k in ERROR_COUNTERS}
    return (f"soak: t={point['t']:.0f}s requests={point['requests']} node RSS "
            f"{rss / 2**20:.0f} MiB shm {point['shm']['bytes'] / 2**20:.0f} MiB "
            f"errors {bad or 0}")


def verdict(warm: dict[str, Any], end: dict[str, Any], code: int | None,
            left: int) -> dict[str, Any]:
    """Every bound, with the figures it was judged on."""
    checks: dict[str, Any] = {}
    for name, last in end["processes"].items():
        first = warm["processes"].get(name)
        if first is None or first["pid"] != last["pid"] or None in (
                first["rss"], last["rss"], first["fds"], last["fds"]):
            checks[f"{name}: same process"] = {"ok": False, "warm": first, "end": last}
            continue
        grew = last["rss"] - first["rss"]
        bound = S3_BUDGET if name == MOTO else max(RSS_GROWTH * first["rss"], RSS_FLOOR)
        checks[f"{name}: RSS growth"] = {"ok": grew < bound, "grew": grew, "bound": int(bound)}
        checks[f"{name}: fd growth"] = {"ok": last["fds"] - first["fds"] <= FD_GROWTH,
                                        "grew": last["fds"] - first["fds"], "bound": FD_GROWTH}
    checks["/dev/shm: no new segment, none past its size"] = {
        "ok": end["shm"]["segments"] <= warm["shm"]["segments"]
        and end["shm"]["bytes"] <= end["shm"]["size"], "warm": warm["shm"], "end": end["shm"]}
    for counter in ERROR_COUNTERS:
        checks[f"errors: {counter}"] = {"ok": end["errors"][counter] == 0,
                                        "count": end["errors"][counter]}
    checks["stopped cleanly, nothing left behind"] = {"ok": code == 0 and left == 0,
                                                      "exit": code, "left": left}
    return {"ok": all(c["ok"] for c in checks.values()), "checks": checks}


def render(report: dict[str, Any]) -> str:
    mib = 2**20
    start, warm, end = report["start"], report["warm"], report["end"]
    lines = [
        f"soak: {report['duration_s']:.0f}s, {report['requests']} requests "
        f"({report['request_rate']:.1f}/s), {report['blocks']} blocks "
        f"({report['block_rate']:.0f}/s of {report['page_size'] // 1024} KiB), "
        f"trace {report['trace']}, speedup {report['speedup']}",
        "",
        f"{'process':<22}{'RSS start':>10}{'warm':>8}{'end':>8}{'growth':>9}"
        f"{'fds start':>10}{'warm':>6}{'end':>6}",
    ]
    rows = {**end["processes"], "engine (this process)": end["engine"]}
    for name, last in rows.items():
        first = start["processes"].get(name, start["engine"] if name.startswith("engine")
                                       else None)
        mid = warm["processes"].get(name, warm["engine"] if name.startswith("engine") else None)
        if first is None or mid is None:
            continue
        growth = (last["rss"] - mid["rss"]) / mid["rss"] if mid["rss"] else 0.0
        lines.append(f"{name:<22}{first['rss'] / mib:>9.1f}M{mid['rss'] / mib:>7.1f}M"
                     f"{last['rss'] / mib:>7.1f}M{growth:>+9.1%}{first['fds']:>10}"
                     f"{mid['fds']:>6}{last['fds']:>6}")
    lines += [
        "",
        f"/dev/shm (this instance): {end['shm']['segments']} segments of "
        f"{end['shm']['size'] / mib:.1f} MiB; allocated: start "
        f"{start['shm']['bytes'] / mib:.1f} MiB, warm {warm['shm']['bytes'] / mib:.1f} MiB, "
        f"end {end['shm']['bytes'] / mib:.1f} MiB; left after stop: {report['left_behind']}",
        "errors: " + ", ".join(f"{k} {v}" for k, v in end["errors"].items()),
        "tier job failures by cause: " + (", ".join(
            f"{name} {cause} {n}" for name, t in end["tiers"].items()
            for cause, n in t.get("failures", {}).items()) or "none"),
        "",
        "verdict (end vs. after warm-up): " + ("PASS" if report["verdict"]["ok"] else "FAIL"),
    ]
    for name, check in report["verdict"]["checks"].items():
        if not check["ok"]:
            lines.append(f"  FAILED {name}: {check}")
    if report["warnings"]:
        lines += ["", f"the node's last {len(report['warnings'])} warnings:",
                  *(f"  {line}" for line in report["warnings"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="soak.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds of load (default 600)")
    parser.add_argument("--max-duration", type=float, default=3600.0,
                        help="upper bound on --duration (default 3600)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the baseline sample (default: a quarter of the "
                             "duration, at most 120)")
    parser.add_argument("--sample-every", type=float, default=15.0)
    parser.add_argument("--trace", type=Path, default=None,
                        help="a Mooncake-format trace (default: the Mooncake conversation "
                             "trace if present, else a synthetic workload)")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="replay arrival times this much faster (default 1: the "
                             "trace's own pace)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.max_duration <= 0 or args.sample_every <= 0:
        parser.error("--duration, --max-duration and --sample-every must be positive")
    if args.speedup <= 0:
        parser.error("--speedup must be positive")
    if args.trace is not None and not args.trace.is_file():
        parser.error(f"--trace {args.trace} does not exist")
    if args.duration > args.max_duration:
        print(f"soak: --duration {args.duration:.0f}s is bounded by --max-duration "
              f"{args.max_duration:.0f}s", file=sys.stderr)
    from tierkv.node.logs import setup_logging

    setup_logging("soak", "warning")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: STOP.set())
    report = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    print(render(report))
    if args.out is not None:
        print(f"\nreport: {args.out}")
    return 0 if report["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
