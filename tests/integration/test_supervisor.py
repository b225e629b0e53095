"""The node as a product: `tierkv up`, restarts, leftovers, status, metrics, the demo."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import new_instance
from tests.integration.cluster import LAYOUT, keys, leftovers, make_config
from tierkv.client import Client
from tierkv.core.shm import process_start_time
from tierkv.engine import KVLayout, allocate_kv_cache
from tierkv.node.config import Config, dump_config, tier_name
from tierkv.node.lifecycle import READY_FD_ENV, ChildFailed
from tierkv.node.supervisor import ChildSpec, Node

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_supervisor(config: Config, path: Path) -> subprocess.Popen:
    path.write_text(dump_config(config))
    return subprocess.Popen(
        [sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )


def wait_status(config: Config, predicate, proc: subprocess.Popen,  # noqa: ANN001
                timeout: float = 60.0) -> dict:
    """The status file of the supervisor `proc` once `predicate` holds."""
    path = config.run_path / "supervisor.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the supervisor exited with {proc.returncode}")
        try:
            status = json.loads(path.read_text())
            if status["pid"] == proc.pid and predicate(status):
                return status
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"supervisor status did not reach the expected state in {timeout}s")


def alive(pid: int) -> bool:
    return process_start_time(pid) is not None and _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_supervisor(proc: subprocess.Popen, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(10)


def child_pids(status: dict) -> dict[str, int]:
    return {c["name"]: c["pid"] for c in status["children"]}


def all_ready(config: Config):  # noqa: ANN201
    names = {"broker", "worker0", *(f"tier:{tier_name(t)}:0" for t in config.tiers)}
    return lambda s: {c["name"] for c in s["children"] if c["alive"]} >= names


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A supervised node (broker, CPU worker, memory tier) with metrics on."""
    instance = new_instance()
    run_dir = tmp_path_factory.mktemp("node")
    config = make_config(instance, run_dir, broker={"metrics_port": free_port()},
                         supervisor={"broker_probe_s": 0.5, "broker_probe_misses": 3},
                         tiers=[{"type": "memory", "name": "mem", "capacity_blocks": 256}])
    proc = start_supervisor(config, run_dir / "node.toml.in")
    kv = engine = None
    try:
        wait_status(config, all_ready(config), proc)
        kv = allocate_kv_cache(instance, 0, KVLayout.blocks_outer(num_blocks=32, **LAYOUT))
        # The engine's client lives as long as its KV cache: its registration is its own.
        engine = Client.from_config(config)
        engine.register_kv(0, kv.registration())
        yield config, proc, kv, engine
    finally:
        if engine is not None:
            engine.close()
        code = stop_supervisor(proc)
        if kv is not None:
            kv.close()
        assert code == 0, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        assert leftovers(run_dir, instance) == []


def round_trip(node, ks: list[bytes]) -> None:  # noqa: ANN001
    config, _, kv, engine = node
    view = kv.tensors[0].view(32, -1)
    view[: len(ks)] = 7
    with Client.from_config(config) as c:
        c.use_kv(engine.registration_tokens)
        store = c.store(ks, list(range(len(ks))))
        assert c.wait([store.job_id], timeout=30)[store.job_id].success
        view[: len(ks)] = 0
        assert c.lookup(ks).hits == len(ks)
        load = c.load(ks, list(range(len(ks))))
        assert c.wait([load.job_id], timeout=30)[load.job_id].success
    assert bool((view[: len(ks)] == 7).all())


@pytest.mark.parametrize("victim", ["tier:mem:0", "worker0"])
def test_killed_child_is_restarted_and_the_node_keeps_serving(node, victim):
    config, proc, kv, _ = node
    before = wait_status(config, all_ready(config), proc)
    old = child_pids(before)[victim]
    os.kill(old, signal.SIGKILL)
    after = wait_status(config, lambda s: any(
        c["name"] == victim and c["pid"] != old and c["alive"] and c["restarts"] >= 1
        for c in s["children"]), proc)
    assert child_pids(after)[victim] != old
    # The restarted worker gets the engine's KV cache back from the broker.
    deadline = time.monotonic() + 30
    with Client.from_config(config) as c:
        while time.monotonic() < deadline:
            peers = c.stats()["peers"]
            if any(p["pid"] == child_pids(after)[victim] and p["state"] == "ready"
                   and p.get("kv_attached", True) for p in peers):
                break
            time.sleep(0.2)
    round_trip(node, keys(100 + len(victim), 200 + len(victim), prefix=victim.encode()[:4]))


def test_hung_broker_is_killed_and_restarted_by_the_probe(node):
    """A SIGSTOPped broker does not exit, so only the probe can notice it: after 3
    missed probes the supervisor kills that pid, restarts the broker, and the worker
    (with the engine's KV cache) and the tier say hello to the new one."""
    config, proc, kv, _ = node
    old = child_pids(wait_status(config, all_ready(config), proc))["broker"]
    os.kill(old, signal.SIGSTOP)
    try:
        after = wait_status(config, lambda s: child_pids(s)["broker"] != old
                            and all_ready(config)(s), proc, timeout=60)
    finally:
        if alive(old):
            os.kill(old, signal.SIGCONT)
    assert not alive(old)
    new = child_pids(after)["broker"]
    deadline = time.monotonic() + 30
    with Client.from_config(config) as c:
        while time.monotonic() < deadline:
            stats = c.stats()
            if stats["pid"] == new and sum(p["state"] == "ready" and p.get("kv_attached", True)
                                          for p in stats["peers"]) == 2:
                break
            time.sleep(0.2)
    round_trip(node, keys(300, 301, 302, prefix=b"hang"))


def test_metrics_answer_and_counters_move(node):
    config, _, _, _ = node
    url = f"http://127.0.0.1:{config.broker.metrics_port}/metrics"

    def lookups() -> float:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        line = next(x for x in text.splitlines() if x.startswith("tierkv_lookups_total"))
        return float(line.split()[-1])

    time.sleep(0.6)
    first = lookups()
    with Client.from_config(config) as c:
        for _ in range(5):
            c.lookup(keys(1, 2, 3))
    time.sleep(1.2)  # the snapshot is refreshed twice a second
    assert lookups() >= first + 5
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for name in ("tierkv_hit_blocks_total", "tierkv_transfer_bytes_total",
                 "tierkv_jobs_in_flight", "tierkv_peer_up", "tierkv_cpu_usage_ratio",
                 "tierkv_evictions_total", "tierkv_job_failures_total"):
        assert name in text


def test_status_shows_processes_and_tiers(node, tmp_path):
    config, _, _, _ = node
    path = tmp_path / "c.toml"
    path.write_text(dump_config(config))
    out = subprocess.run([sys.executable, "-m", "tierkv.cli", "status", "-c", str(path)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for word in ("broker", "worker0", "tier:mem:0", "restarts", "hit ratio", "mem", "cpu"):
        assert word in out.stdout
    assert f"log: {config.run_path / 'node.log'}" in out.stdout
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "status", "-c", str(path), "--json"], cwd=REPO,
        capture_output=True, text=True, timeout=60).stdout)
    assert data["broker"]["state"] == "running"


def test_start_stop_cycles_leave_nothing_and_say_stopped_once_per_process(tmp_path):
    """A clean stop must not end with a "lost the broker ... reconnecting"
    warning per peer, and must say what stopped. The node's log
    is a file in the run directory, the supervisor's lines and every process's."""
    instance = new_instance()
    config = make_config(instance, tmp_path / "run", tiers=[{"type": "memory", "name": "m"}])
    for cycle in range(2):
        proc = start_supervisor(config, tmp_path / f"c{cycle}.toml")
        try:
            started = child_pids(wait_status(config, all_ready(config), proc))
        finally:
            assert stop_supervisor(proc) == 0
        assert not any(alive(pid) for pid in started.values())
        assert leftovers(config.run_path, instance) == []
        assert not (config.run_path / "supervisor.json").exists()
        echoed = proc.stderr.read().decode()
        logged = (config.run_path / "node.log").read_text()
        this_run = logged[logged.rindex(f"node {instance} starting"):]
        for text in (echoed, this_run):
            assert " WARNING " not in text and " ERROR " not in text, text[-3000:]
            stopped = [line for line in text.splitlines() if line.endswith(" stopped")]
            assert len(stopped) == 4, stopped  # broker, worker, tier, and the node
            for name, pid in started.items():
                assert any(f"pid={pid} " in line for line in stopped), (name, stopped)
            assert stopped[-1].endswith(f"node {instance} stopped")
        assert "[supervisor]" in this_run and "[broker]" in this_run and "[tier:m]" in this_run


# A child that counts the SIGTERMs it gets until it has been quiet for half a second,
# and exits with that count less one: 0 when it was asked to stop once.
COUNTING_CHILD = f"""
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append(time.monotonic()))
fd = int(os.environ["{READY_FD_ENV}"])
os.write(fd, b"ready\\n")
os.close(fd)
while not got or time.monotonic() - got[-1] < 0.5:
    time.sleep(0.01)
sys.exit(len(got) - 1)
"""


def test_a_node_stop_sends_each_child_one_sigterm(tmp_path, monkeypatch):
    """A second SIGTERM could reach a child after it stopped cleanly, while Python
    exits with the default handler back: it then died of it (-15) and the stop
    reported it as a failure."""
    specs = Node.specs
    monkeypatch.setattr(Node, "specs", lambda self: [*specs(self), ChildSpec(
        "tier:counting:0", "tier", (sys.executable, "-c", COUNTING_CHILD))])
    node = Node(make_config(new_instance(), tmp_path / "run"))
    node.start()
    codes = node.stop()
    assert "tier:counting:0" in codes and codes == dict.fromkeys(codes, 0), codes


def test_supervisor_killed_children_stop_and_a_new_start_cleans_up(tmp_path):
    instance = new_instance()
    config = make_config(instance, tmp_path / "run", tiers=[{"type": "memory"}])
    proc = start_supervisor(config, tmp_path / "a.toml")
    try:
        started = child_pids(wait_status(config, all_ready(config), proc))
        pids, child_names = started.values(), set(started)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), "children outlived their supervisor"
    # `tierkv status` must not read "running" from the dead supervisor's file.
    out = status_text(config, tmp_path / "status.toml")
    assert out.returncode == 1  # the broker does not answer
    assert f"supervisor: pid {proc.pid} is not running" in out.stdout, out.stdout
    rows = [line.split() for line in out.stdout.splitlines()
            if line.split() and line.split()[0] in child_names]
    assert len(rows) == len(child_names) and all(r[2] == "exited" and r[3] == "-"
                                                  for r in rows), out.stdout
    # The next start sweeps whatever the dead run left and comes up cleanly.
    proc = start_supervisor(config, tmp_path / "b.toml")
    try:
        wait_status(config, all_ready(config), proc)
    finally:
        assert stop_supervisor(proc) == 0
    assert leftovers(config.run_path, instance) == []


def test_bad_config_is_one_clear_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[cpu]\nnum_blocks = 'lots'\n")
    out = subprocess.run([sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "cpu.num_blocks must be int" in out.stderr and str(path) in out.stderr


def test_bad_cli_arguments_are_refused(tmp_path):
    for argv in (["tierkv.cli", "nonsense"], ["workers.tier_worker"],
                 ["workers.gpu_worker", "--rank", "x"]):
        out = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2, argv
        assert out.stderr.strip(), argv


def test_demo_quick_reports_hits_from_every_tier(tmp_path):
    demo = subprocess.Popen(
        [sys.executable, "-m", "tierkv.cli", "demo", "--quick", "--no-progress",
         "--out", str(tmp_path)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        stdout, stderr = demo.communicate(timeout=400)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
    out = subprocess.CompletedProcess(demo.args, demo.returncode, stdout, stderr)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    served = report["served_blocks"]
    assert served["cpu"] > 0 and served["disk"] > 0 and served["s3"] > 0, served
    # One accounting; every block the requests needed, once.
    assert sum(served.values()) + report["recomputed_blocks"] == report["blocks"]
    shares = [float(line.split()[2].rstrip("%")) for line in out.stdout.splitlines()
              if line.split()[:1] in (["cpu"], ["disk"], ["s3"], ["recomputed"])
              and line.endswith("%")]
    assert len(shares) == 4 and abs(sum(shares) - 100.0) <= 0.2, out.stdout
    # Real windows of completed requests, none empty, none skipped.
    series = report["series"]
    assert sum(p["requests"] for p in series) == report["requests"]
    assert all(p["requests"] >= report["window_requests"] for p in series[:-1])
    assert all(p["blocks"] > 0 for p in series)
    # The lookup figure says what it measured and what it waited on.
    assert sum(k["count"] for k in report["lookups"].values()) == report["requests"]
    assert "admission until answered" in out.stdout and "promotion:" in out.stdout
    assert report["integrity"]["mismatches"] == 0
    assert report["integrity"]["blocks_verified"] > 0
    assert report["failed_jobs"] == 0
    assert (tmp_path / "hit_ratio.png").stat().st_size > 1000
    assert "integrity" in out.stdout and "0 mismatches" in out.stdout
    # Its instance is demo<pid>: other demos may be running on this machine.
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"tierkv.demo{demo.pid}.")]


def status_text(config: Config, path: Path) -> subprocess.CompletedProcess:
    path.write_text(dump_config(config))
    return subprocess.run([sys.executable, "-m", "tierkv.cli", "status", "-c", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def uptime_s(text: str, process: str) -> int:
    row = next(line.split() for line in text.splitlines() if line.startswith(process + " "))
    h, m, s = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", row[3]).groups()
    return int(h or 0) * 3600 + int(m or 0) * 60 + int(s or 0)


def test_status_computes_uptimes_now_not_when_the_status_file_was_written(node):
    """The status file is written when something changes, so an uptime
    read from it stands still."""
    from tierkv.node.status import gather, render

    config, proc, _, _ = node
    wait_status(config, all_ready(config), proc)
    status = gather(config)
    now = time.time()
    later = render(status, now=now + 600)
    assert uptime_s(later, "worker0") - uptime_s(render(status, now=now), "worker0") == 600
    assert f"supervisor: pid {proc.pid}, up" in later


def test_a_refused_second_up_touches_nothing_of_the_running_node(node, tmp_path):
    """A second `tierkv up` of a running instance used to overwrite the
    run directory's node.toml and delete supervisor.json before it was refused. Two
    real `tierkv up`: one from the same run directory with other tiers, one from
    another run directory; both are refused and the running node is as it was."""
    config, proc, _, _ = node
    status = wait_status(config, all_ready(config), proc)
    region = Path("/dev/shm") / f"tierkv.{config.instance}.cpu"

    def fingerprint() -> dict[str, tuple]:
        found = {}
        for entry in [*config.run_path.iterdir(), region]:
            if entry.name == "node.log":
                continue  # the running node writes it
            st = entry.stat()
            content = entry.read_bytes() if entry.is_file() and entry != region else b""
            found[entry.name] = (st.st_ino, st.st_mtime_ns, st.st_size, content)
        return found

    before = fingerprint()
    assert {"node.toml", "supervisor.json", "client.sock"} <= before.keys()
    same_dir = make_config(config.instance, config.run_path,
                           tiers=[{"type": "memory", "name": "other", "capacity_blocks": 8}])
    other_dir = make_config(config.instance, tmp_path / "elsewhere", tiers=[])
    for i, second in enumerate((same_dir, other_dir)):
        path = tmp_path / f"second{i}.toml"
        path.write_text(dump_config(second))
        out = subprocess.run([sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr[-2000:]
        assert "already running" in out.stderr and "nothing was changed" in out.stderr
        assert fingerprint() == before
    with Client.from_config(config) as c:
        assert c.stats()["pid"] == child_pids(status)["broker"]
    assert wait_status(config, all_ready(config), proc) == status


def test_a_bad_tier_entry_stops_up_before_anything_starts(tmp_path, instance):
    """Tier options were once checked only in the tier process, after the
    broker and the workers were up, and the error did not name the file."""
    run_dir = tmp_path / "run"
    cases = [
        ('type = "disk"\nroot = "{root}"\nbudget_bytes = "lots"',
         "tiers[0].budget_bytes must be int"),
        ('type = "disk"\nroot = "{root}/missing"\nbudget_bytes = 1000000',
         "tiers[0].root '{root}/missing' does not exist"),
        ('type = "s3"\nbucket = "b"\nendpoint_url = "embedded"',
         "tiers[0].bucket 'b' is not a valid"),
        ('type = "memory"\ncapacity = 3', "tiers[0].capacity is an unknown option"),
    ]
    for i, (entry, said) in enumerate(cases):
        path = tmp_path / f"bad{i}.toml"
        path.write_text(f'instance = "{instance}"\nrun_dir = "{run_dir}"\n[worker]\n'
                        f'device = "cpu"\n[[tiers]]\n{entry.format(root=tmp_path)}\n')
        out = subprocess.run([sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.strip().count("\n") == 0, out.stderr  # one line
        assert said.format(root=tmp_path) in out.stderr and str(path) in out.stderr
        assert not run_dir.exists()  # nothing started, nothing written
        assert leftovers(run_dir, instance) == []


def test_a_metrics_port_in_use_is_named_by_its_key_and_address(tmp_path, instance):
    """Not `cannot start: [Errno 98] Address already in use`, which named neither
    the key nor the port. `tierkv up` says so before anything starts; a broker run
    by hand says the same."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = make_config(instance, tmp_path / "run", broker={"metrics_port": port},
                             tiers=[])
        path = tmp_path / "c.toml"
        path.write_text(dump_config(config))
        said = f"broker.metrics_port = {port}: 127.0.0.1:{port} is already in use"
        up = subprocess.run([sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
        assert up.returncode == 2 and said in up.stderr, up.stderr[-2000:]
        assert not (config.run_path / "node.toml").exists()
        broker = subprocess.run([sys.executable, "-m", "broker", "-c", str(path)], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert broker.returncode == 1 and said in broker.stderr, broker.stderr[-2000:]
    Node(config).cleanup()  # a broker run by hand leaves its sockets to whoever starts next
    assert leftovers(config.run_path, instance) == []


def test_a_failed_start_does_not_call_its_own_leftovers_an_earlier_runs(tmp_path, instance,
                                                                       caplog):
    """After its own broker failed at start, the supervisor must not log that
    it "cleaned up after an earlier run" about that broker's sockets."""
    caplog.set_level(logging.DEBUG, logger="tierkv.node.supervisor")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        config = make_config(instance, tmp_path / "run", broker={"tier_address": address},
                             tiers=[])
        with pytest.raises(ChildFailed, match="Address already in use"):
            Node(config).start()  # the client and worker sockets were bound first
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "earlier run" in m], messages
    assert leftovers(config.run_path, instance) == []


def test_a_child_that_prints_a_huge_line_costs_the_node_log_a_few_kib(tmp_path):
    """One line of a child may be many MiB (a foreign value logged
    whole); the supervisor's pump keeps a bounded prefix and its length."""
    from tierkv.node.lifecycle import spawn, stop
    from tierkv.node.logs import NodeLog

    node_log = NodeLog(tmp_path / "node.log", max_bytes=1 << 20, count=2)
    code = "import sys; sys.stdout.write('z' * (16 << 20) + '\\nafter\\n')"
    child = spawn("talker", [sys.executable, "-c", code], sink=node_log.write_line)
    try:
        child.proc.wait(60)
        assert child._reader is not None
        child._reader.join(60)
    finally:
        stop(child, 5)
        node_log.close()
    text = (tmp_path / "node.log").read_text()
    assert text.splitlines() == [text.splitlines()[0], "after"]
    assert f"[cut: the line had {16 << 20:,} bytes]" in text
    assert (tmp_path / "node.log").stat().st_size < 8192
    assert list(child.log_lines)[-1] == "after"
