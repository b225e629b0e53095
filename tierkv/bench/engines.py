"""`tierkv bench engines` (opt-in): what N vLLM engines on one node cost its broker.

    tierkv bench engines [--quick] [--repeats N]
    python -m tierkv.bench.engines [--engines 1,2,4,8] [--quick] [--repeats N]

A node has one broker process, and every engine on the host asks it at every
step. This runs N = 1, 2, 4, 8 engine processes against one node (one broker, a
CPU tier sized for all of them), each running vLLM 0.33's real scheduler with
tierkv behind it on `tierkv bench vllm`'s offloading-tier workload (`--tierkv-hits`,
a quarter of the requests queued; `tierkv.bench.vllm.step_times`), each engine in a
namespace of its own so that none is served another's blocks. The engines warm up,
wait for each other, and run their timed steps at once; around that window the
broker's CPU time is read from /proc. Rows, each against N=1 in the same repeat:

* each engine's median scheduler step (ms) at N;
* the broker's CPU seconds per engine step (its CPU time over the window, all its
  threads, divided by the engine steps in it). This is the figure to carry to a
  bigger host: on a machine with fewer cores than engines the engines' step times
  grow because they share cores, while the broker's work per step should not.
  Goal: at most GOAL_FLAT (1.2) x N=1's at N=8.

* the broker loop's longest turn (`broker.turns`: one message handled, or a tick;
  in CPU time, which carries to a host with a core for each process) in the
  window's last seconds: the longest a step may wait behind the broker's work.
  Goal: at most GOAL_TURN (2) x N=1's at N=8.

The processes it starts (the engines, the node) are ended by pid when it ends,
also on an error; the node's shared memory and sockets go with it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any, cast

from tierkv.bench.common import FLAT, Budget, Options, Part, Row, Stat, ratio, summary_table
from tierkv.bench.vllm import Timed, Workload

GOAL_FLAT = 1.2  # broker CPU per engine step at N=8 over N=1's, at most
GOAL_ENGINES = 8
GOAL_TURN = 2.0  # the broker loop's longest turn at N=8 over N=1's, at most
ENGINES = (1, 2, 4, 8)
QUICK_ENGINES = (1, 2, 4)
REPO = Path(__file__).resolve().parents[2]
PREFIX = "tierkv-engines: "  # the child's protocol lines on stdout (vLLM may log there)
# Bounds on every wait for the engine processes: importing vLLM (all of them at
# once, on a small host), then per measurement a base plus a bound per step.
START_TIMEOUT_S = 300.0
RUN_TIMEOUT_BASE_S = 120.0
RUN_TIMEOUT_PER_STEP_S = 0.25
STOP_TIMEOUT_S = 10.0


def workload(quick: bool) -> Workload:
    """`tierkv bench vllm`'s third workload: the offloading tier's hits, a quarter
    of the requests waiting in vLLM's queue."""
    hits = Workload(requests=64 if quick else 256, steps=40 if quick else 300,
                    warmup=20 if quick else 60).tierkv_hits()
    return replace(hits, queued=hits.requests // 4)


# -- the broker's CPU time, from /proc -------------------------------------------------


def stat_cpu_seconds(stat_text: str, ticks_per_s: int) -> float:
    """utime + stime of a /proc/<pid>/stat line, in seconds (every thread of the
    process). The name (field 2) may hold spaces and parentheses: the fields are
    counted from its last ')'."""
    fields = stat_text.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / ticks_per_s


def schedstat_seconds(schedstat_text: str) -> float:
    """The time on a CPU of one /proc/<pid>/task/<tid>/schedstat, in seconds: the
    kernel counts it in nanoseconds, where /proc/<pid>/stat counts clock ticks
    (10 ms), too coarse for a short window."""
    return int(schedstat_text.split()[0]) / 1e9


@dataclass(frozen=True)
class CpuReading:
    """A process's CPU time: `ticks` from /proc/<pid>/stat (clock-tick resolution),
    `precise` the sum of its threads' schedstat (ns), or None where the kernel
    has no schedstat."""

    ticks: float
    precise: float | None

    def best(self) -> float:
        return self.precise if self.precise is not None else self.ticks


def read_cpu(pid: int) -> CpuReading:
    with open(f"/proc/{pid}/stat") as f:
        ticks = stat_cpu_seconds(f.read(), os.sysconf("SC_CLK_TCK"))
    precise: float | None = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    precise = cast(float, precise) + schedstat_seconds(f.read())
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
    except OSError:
        precise = None
    return CpuReading(ticks, precise)


# -- one measurement and the rows -------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One timed window of `engines` engines on one broker: each engine's median
    step seconds, the timed steps each ran, the broker's CPU seconds over the window
    (precise and from clock ticks), its wall seconds and the broker's requests."""

    repeat: int
    engines: int
    medians: list[float]
    steps: int
    broker_cpu_s: float
    broker_cpu_ticks_s: float
    wall_s: float
    broker_requests: int = 0
    hit_tokens: int = 0
    instance: str = ""  # the node's: its shared memory and sockets are named after it
    # The broker loop's longest turn in the last seconds of the window, and its mean
    # over the window (`broker.turns`): what a step may wait behind it.
    longest_turn_s: float = 0.0
    mean_turn_s: float = 0.0

    @property
    def engine_steps(self) -> int:
        return self.engines * self.steps

    @property
    def cpu_per_step(self) -> float:
        """The broker's CPU seconds per engine step."""
        return self.broker_cpu_s / self.engine_steps

    @property
    def median_step(self) -> float:
        """The median over the engines of their median step."""
        return statistics.median(self.medians)


def _paired(windows: Sequence[Window], base: Sequence[Window],
            value: str) -> tuple[list[float], list[float]]:
    """`value` of each window and of the base window of the same repeat (repeats
    the base lacks are left out)."""
    by_repeat = {w.repeat: getattr(w, value) for w in base}
    pairs = [(getattr(w, value), by_repeat[w.repeat]) for w in windows if w.repeat in by_repeat]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def rows(windows: Sequence[Window], requests: int) -> list[Row]:
    """Per N, the engines' step row and the broker's CPU row, each against the
    smallest N in the same repeat (FLAT: 1.0 = does not grow with N)."""
    counts = sorted({w.engines for w in windows})
    if not counts:
        return []
    base_n = counts[0]
    base = [w for w in windows if w.engines == base_n]
    out: list[Row] = []
    for n in counts:
        at_n = [w for w in windows if w.engines == n]
        repeats = len(at_n)
        steps, base_steps = _paired(at_n, base, "median_step")
        medians = [m for w in at_n for m in w.medians]
        out.append(Row(
            "engines", f"engine step, {n} engine{'s' if n > 1 else ''} on one broker",
            Stat.of(medians).scaled(1e3), "ms", f"N={base_n} on the same broker",
            ratio(steps, base_steps), Stat.of([w.median_step for w in base]).scaled(1e3),
            want=FLAT, headline=n == counts[-1],
            note=f"each engine's median of {at_n[0].steps} steps, {requests} requests each "
                 f"(a quarter queued), {repeats} repeat{'s' if repeats > 1 else ''}; the "
                 f"engines share this host's {os.cpu_count()} cores"))
        cpu, base_cpu = _paired(at_n, base, "cpu_per_step")
        share = statistics.median(w.broker_cpu_s / w.wall_s for w in at_n if w.wall_s > 0) \
            if any(w.wall_s > 0 for w in at_n) else 0.0
        ticks = statistics.median(w.broker_cpu_ticks_s / w.engine_steps for w in at_n)
        asks = statistics.median(w.broker_requests / w.engine_steps for w in at_n)
        flat = ratio(cpu, base_cpu)
        goal = f"goal at N={GOAL_ENGINES}: <= {GOAL_FLAT}x N={base_n}"
        if n == GOAL_ENGINES and base_n == 1:
            goal += f" ({'met' if flat.median <= GOAL_FLAT else 'missed'})"
        out.append(Row(
            "engines", f"broker CPU per engine step, {n} engine{'s' if n > 1 else ''}",
            Stat.of([w.cpu_per_step for w in at_n]).scaled(1e6), "us",
            f"N={base_n} on the same broker", flat,
            Stat.of([w.cpu_per_step for w in base]).scaled(1e6), want=FLAT,
            note=f"{goal}; the broker's CPU (all threads, schedstat) over the timed window "
                 f"/ {at_n[0].engine_steps} engine steps; from /proc stat ticks "
                 f"{ticks * 1e6:.0f} us; broker busy {share:.0%} of a core; "
                 f"{asks:.2f} broker requests per engine step"))
        longest, base_longest = _paired(at_n, base, "longest_turn_s")
        if any(base_longest):
            out.append(Row(
                "engines", f"broker's longest turn, {n} engine{'s' if n > 1 else ''}",
                Stat.of(longest).scaled(1e3), "ms", f"N={base_n} on the same broker",
                ratio(longest, base_longest), Stat.of(base_longest).scaled(1e3), want=FLAT,
                note=f"goal: at most {GOAL_TURN}x N={base_n} (the longest a step may wait "
                     f"behind the broker, in CPU time, over the window's last seconds); mean turn "
                     f"{statistics.median(w.mean_turn_s for w in at_n) * 1e6:.0f} us"))
    return out


# -- the engine processes ---------------------------------------------------------------


class EngineProcs:
    """`count` engine processes (`python -m tierkv.bench.engines --child`), their
    protocol lines gathered by a reader thread each; every one ended by pid on
    `close`."""

    def __init__(self, count: int, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.lines: list[queue.Queue[dict[str, Any] | None]] = []
        self.logs: list[Path] = []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        try:
            for i in range(count):
                log = log_dir / f"engine{i}.log"
                with open(log, "w") as err:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "tierkv.bench.engines", "--child"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                        cwd=str(REPO), env=env)
                lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
                self.procs.append(proc)
                self.lines.append(lines)
                self.logs.append(log)
                threading.Thread(target=self._read, args=(proc, lines), daemon=True,
                                 name=f"engine{i}-reader").start()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.Queue[dict[str, Any] | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PREFIX):
                lines.put(json.loads(line[len(PREFIX):]))
        lines.put(None)  # end of its stdout: it exited

    def send(self, index: int, message: dict[str, Any]) -> None:
        stdin = self.procs[index].stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(message) + "\n")
            stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(self._gone(index)) from None

    def expect(self, indices: Sequence[int], event: str, timeout_s: float) -> list[dict[str, Any]]:
        """The next `event` line of each engine in `indices`, in their order, within
        `timeout_s` all together."""
        deadline = time.monotonic() + timeout_s
        got = []
        for i in indices:
            try:
                line = self.lines[i].get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"engine {i} did not say {event!r} within {timeout_s:.0f} s; "
                                   f"last lines of {self.logs[i]}: {_tail(self.logs[i])}") from None
            if line is None:
                raise RuntimeError(self._gone(i))
            if line.get("event") != event:
                raise RuntimeError(f"engine {i} said {line!r}, not {event!r}")
            got.append(line)
        return got

    def _gone(self, index: int) -> str:
        proc = self.procs[index]
        return (f"engine {index} (pid {proc.pid}) exited with status {proc.poll()}; last lines "
                f"of {self.logs[index]}: {_tail(self.logs[index])}")

    def close(self) -> None:
        """Each asked to exit, then ended by its pid (SIGTERM, then SIGKILL)."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is None and proc.stdin is not None:
                try:
                    self.send(i, {"cmd": "exit"})
                except (RuntimeError, OSError, ValueError):
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def measure(procs: EngineProcs, engines: int, work: Workload, repeat: int) -> Window:
    """One window: a fresh node sized for `engines` engines, the first `engines`
    processes run `work` on it in namespaces of their own, their timed steps at once."""
    from tierkv.bench.vllm_setup import EngineShape, engine_node
    from tierkv.client import Client

    indices = list(range(engines))
    timeout = RUN_TIMEOUT_BASE_S + RUN_TIMEOUT_PER_STEP_S * engines * (work.warmup + work.steps)
    with engine_node(EngineShape().page_size, engines * work.cpu_blocks) as node:
        broker = node.children["broker"].proc.pid
        for i in indices:
            procs.send(i, {"cmd": "run", "config": str(node.config_path),
                           "namespace": f"bench-engines-{repeat}-{i}",
                           "workload": asdict(work)})
        try:
            procs.expect(indices, "ready", timeout)
            with Client.from_config(node.config) as client:
                # Its own stats request is counted before it is answered.
                stats = client.stats()
                before, turns_before = stats["broker"].get("requests", 0), stats.get("turns", {})
                start_cpu, start = read_cpu(broker), time.monotonic()
                for i in indices:
                    procs.send(i, {"cmd": "go"})
                results = procs.expect(indices, "result", timeout)
                end_cpu, wall = read_cpu(broker), time.monotonic() - start
                stats = client.stats()
                after, turns_after = stats["broker"].get("requests", 0) - 1, stats.get("turns", {})
        finally:
            for i in indices:  # also on an error: the engines close before the node
                if procs.procs[i].poll() is None:
                    procs.send(i, {"cmd": "end"})
        procs.expect(indices, "closed", timeout)
    steps = {len(r["seconds"]) for r in results}
    if len(steps) != 1:
        raise RuntimeError(f"the engines ran different numbers of timed steps: {steps}")
    precise = (end_cpu.precise - start_cpu.precise
               if end_cpu.precise is not None and start_cpu.precise is not None else None)
    return Window(repeat, engines, [statistics.median(r["seconds"]) for r in results],
                  steps.pop(), precise if precise is not None else end_cpu.ticks -
                  start_cpu.ticks, end_cpu.ticks - start_cpu.ticks, wall,
                  after - before,
                  sum(int(r["hits"]) for r in results), node.config.instance,
                  turns_after.get("recent_longest_ms", 0.0) / 1e3,
                  mean_turn(turns_before, turns_after))


def mean_turn(before: dict[str, Any], after: dict[str, Any]) -> float:
    """The broker loop's mean turn between two readings of its `turns` stats."""
    count = after.get("count", 0) - before.get("count", 0)
    return (after.get("busy_s", 0.0) - before.get("busy_s", 0.0)) / count if count > 0 else 0.0


def run_engines(part: Part, counts: Sequence[int], work: Workload, repeats: int) -> list[Window]:
    """Every count in `counts`, repeat after repeat (each repeat runs every count in
    turn, so that a ratio pairs windows measured close together); the rows added
    at the end from what the budget let run."""
    windows: list[Window] = []
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-engines-") as tmp:
        procs = EngineProcs(max(counts), Path(tmp))
        try:
            procs.expect(range(max(counts)), "up", START_TIMEOUT_S)
            for repeat in range(repeats):
                for n in counts:
                    if part.over_budget(f"N={n}, repeat {repeat + 1} and after"):
                        break
                    w = measure(procs, n, work, repeat)
                    print(f"  # N={n} repeat {repeat + 1}: engine medians "
                          f"{', '.join(f'{m * 1e3:.2f}' for m in w.medians)} ms; broker CPU "
                          f"{w.cpu_per_step * 1e6:.1f} us per engine step "
                          f"({w.broker_cpu_s * 1e3:.1f} ms over {w.wall_s:.2f} s)",
                          file=part.out, flush=True)
                    windows.append(w)
                else:
                    continue
                break
        finally:
            procs.close()
    for row in rows(windows, work.requests):
        part.add(row)
    return windows


def run(part: Part, opts: Options) -> None:
    run_engines(part, QUICK_ENGINES if opts.quick else ENGINES, workload(opts.quick),
                opts.pick(1, 3))


# -- the engine process -------------------------------------------------------------------


def _same(extra: dict[str, Any], _node: Any) -> dict[str, Any]:
    """The engine's extra config, whatever node step_times hands it (none here: the
    node is the parent's)."""
    return extra


def say(event: str, **fields: Any) -> None:
    print(PREFIX + json.dumps({"event": event, **fields}), flush=True)


def child(commands: IO[str]) -> int:
    """An engine process: vLLM imported once, then per `run` command one engine on
    the node named, warmed up; it says `ready`, waits for `go`, runs its timed
    steps, says its `result`, waits for `end`, closes the engine and says
    `closed`. `exit` (or the end of stdin) ends it."""
    from contextlib import nullcontext

    from tierkv.bench.vllm import step_times
    from tierkv.bench.vllm_setup import tierkv_extra_config

    def wait_for(cmd: str) -> None:
        line = commands.readline()
        got = json.loads(line).get("cmd") if line.strip() else "exit"
        if got != cmd:
            raise SystemExit(f"expected {cmd!r}, got {got!r}")

    def ready() -> None:
        say("ready")
        wait_for("go")

    def report(timed: Timed) -> None:
        say("result", seconds=timed.seconds, hits=timed.offloaded_hit_tokens)
        wait_for("end")

    say("up")
    for line in commands:
        msg = json.loads(line)
        if msg.get("cmd") == "exit":
            break
        if msg.get("cmd") != "run":
            raise SystemExit(f"unknown command {msg!r}")
        node = cast(Any, SimpleNamespace(config_path=msg["config"]))
        extra: dict[str, Any] = tierkv_extra_config(node, namespace=msg["namespace"])
        step_times(partial(_same, extra), Workload(**msg["workload"]), nullcontext(),
                   before_timed=ready, after_timed=report)
        say("closed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.engines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=None,
                        help="engine counts, comma-separated (default 1,2,4,8; --quick 1,2,4)")
    parser.add_argument("--quick", action="store_true", help="64 requests, 40 timed steps")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--quick 1)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per engine (default 256, --quick 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per engine")
    parser.add_argument("--budget", type=float, default=1200.0, metavar="SECONDS")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(sys.stdin)
    try:
        counts = sorted({int(n) for n in args.engines.split(",")}) if args.engines else list(
            QUICK_ENGINES if args.quick else ENGINES)
    except ValueError:
        parser.error(f"--engines must be numbers, comma-separated, got {args.engines!r}")
    if not counts or counts[0] < 1 or (args.repeats is not None and args.repeats < 1):
        parser.error("engine counts and --repeats must be at least 1")
    work = workload(args.quick)
    if args.requests is not None:
        base = Workload(requests=args.requests, steps=work.steps, warmup=work.warmup)
        work = replace(base.tierkv_hits(), queued=args.requests // 4)
    work = replace(work, steps=args.steps or work.steps,
                   warmup=args.warmup if args.warmup is not None else work.warmup)
    part = Part("engines", Budget(args.budget), sys.stdout)
    with part.timing():
        run_engines(part, counts, work, Options(quick=args.quick,
                                                repeats=args.repeats).pick(1, 3))
    print("\n" + summary_table([part]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
