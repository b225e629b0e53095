"""Faults under a steady replayed load, on the shared supervised node (conftest):
SIGKILL and SIGSTOP of every process kind, the S3 endpoint stopped and restarted,
hung and slowed, and stalling disk I/O, each at a random (seeded) point of the load.

Every run measures detection, recovery and failed jobs (the figures go to
docs/reliability.md) and checks the issue's bounds: no client call past its
deadline, no block served with wrong bytes, no block reported stored on disk gone
after recovery. Scenario functions are plain functions so the slow variant can run
them again, repeatedly, in random order.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.faults.harness import FaultResult, FaultRun, NodeUnderTest, stopped
from tests.faults.node import gone

PEERS = {  # supervisor child -> (broker peer kind, peer name, label in the figures)
    "worker0": ("worker", "rank0", "worker"),
    "tier:disk:0": ("tier", "disk", "disk tier"),
    "tier:s3:0": ("tier", "s3", "S3 tier"),
}
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}


def _in_flight(stats: dict[str, Any], kind: str, name: str) -> int:
    return int(stats["transfers_in_flight"] if kind == "worker"
               else stats["tiers"][name]["in_flight"])


def _s3(nut: NodeUnderTest, key: str) -> Any:
    stats = nut.stats()
    return None if stats is None else stats["tiers"]["s3"][key]


def _s3_failures(nut: NodeUnderTest) -> int:
    failures = nut.failures()
    return -1 if failures is None else sum(v for k, v in failures.items()
                                           if k.startswith("s3:"))


def _s3_stores_grow(nut: NodeUnderTest) -> Callable[[], bool]:
    """True once the S3 tier stored more blocks than now: cascades go through again."""
    start = _s3(nut, "stores") or 0
    return lambda: (_s3(nut, "stores") or 0) > start


# -- process faults ----------------------------------------------------------------------------


def peer_fault(nut: NodeUnderTest, child: str, signame: str) -> FaultResult:
    """SIGKILL is a crash; SIGSTOP a hang, which the broker must find by heartbeats and
    fence (kill by pid) before it fails the peer's jobs. The supervisor restarts both."""
    kind, name, label = PEERS[child]
    held = 0  # jobs the broker had given the victim after it was hit
    with FaultRun(nut, f"{label} {signame}") as run:
        old = nut.node.pid(child)
        run.inject(lambda: nut.node.send(old, SIGNALS[signame]))

        def dropped() -> bool:
            nonlocal held
            stats = nut.stats()
            if stats is None:
                return False
            if any(p["pid"] == old for p in stats["peers"]):
                held = max(held, _in_flight(stats, kind, name))
                return False
            return True

        run.detected(dropped, timeout=20)
        if signame == "SIGSTOP":
            nut.wait(lambda: gone(old), 10, f"{label} fenced after its hang was detected")
        run.recovered(lambda: nut.node.child_restarted(child, old)
                      and nut.peer_ready(kind, name, old), timeout=90)
    result = run.check()
    if held:  # what the victim held was failed, not left waiting for a dead process
        assert result.failed_jobs > 0, result
    return result


def broker_kill(nut: NodeUnderTest) -> FaultResult:
    """The supervisor restarts the broker (a new, empty CPU tier); workers and tiers
    say hello again by themselves, the workers with the engine's KV registration
    (the probe never registers again), the disk tier with its inventory."""
    with FaultRun(nut, "broker SIGKILL", broker_survives=False) as run:
        old = nut.node.pid("broker")
        run.inject(lambda: nut.node.send(old, signal.SIGKILL))
        run.detected(lambda: nut.node.child_down("broker", old))
        run.recovered(nut.all_ready, timeout=90)
    return run.check(lost_jobs_ok=True)


def broker_stop(nut: NodeUnderTest) -> FaultResult:
    """A hung broker: clients get BrokerUnavailable within their timeout (detected =
    the first one); the supervisor's probe finds it silent 3 times, kills it and
    restarts it, and the peers say hello to the new broker."""
    with FaultRun(nut, "broker SIGSTOP", broker_survives=False) as run:
        old = nut.node.pid("broker")
        try:
            run.inject(lambda: nut.node.send(old, signal.SIGSTOP))
            tally = run.load.driver.tally
            nut.wait(lambda: tally.first_unavailable is not None, 30,
                     "clients see the hung broker")
            run.mark_detected(tally.first_unavailable)
            run.recovered(lambda: nut.node.child_restarted("broker", old)
                          and nut.all_ready(), timeout=120)
        finally:
            if not gone(old):
                nut.node.send(old, signal.SIGCONT)
        assert gone(old), "the hung broker was restarted but not killed"
    return run.check(lost_jobs_ok=True)


def supervisor_kill(nut: NodeUnderTest) -> FaultResult:
    """Children learn of it through their lifeline and stop; a new supervisor cleans
    up what is left and starts the node again, whose disk tier still holds its
    blocks. The engine registers its KV cache with the new workers."""
    node = nut.node
    with FaultRun(nut, "supervisor SIGKILL", broker_survives=False) as run:
        assert node.proc is not None
        run.inject(lambda: node.send(node.proc.pid, signal.SIGKILL))
        run.detected(node.children_gone, timeout=30)
        node.proc.wait(10)
        node.start()
        nut.register()
        run.recovered(nut.all_ready, timeout=90)
    return run.check(lost_jobs_ok=True)


def supervisor_stop(nut: NodeUnderTest) -> FaultResult:
    """A hung supervisor: the node serves on; a child that dies meanwhile is noticed
    by the broker but restarted only once the supervisor runs again."""
    node = nut.node
    assert node.proc is not None
    supervisor = node.proc.pid
    with FaultRun(nut, "supervisor SIGSTOP, disk tier dies") as run:
        old = node.pid("tier:disk:0")

        def fault() -> None:
            node.send(supervisor, signal.SIGSTOP)
            node.send(old, signal.SIGKILL)

        run.inject(fault)
        run.detected(lambda: nut.peer_listed(old) is False)
        assert run.probe.round_trip(), "the node must serve without its supervisor"
        time.sleep(1.0)
        assert not nut.peer_ready("tier", "disk"), "restarted while the supervisor was stopped"
        node.send(supervisor, signal.SIGCONT)
        run.recovered(lambda: node.child_restarted("tier:disk:0", old)
                      and nut.peer_ready("tier", "disk", old))
    return run.check()


# -- I/O faults --------------------------------------------------------------------------------


def s3_endpoint_down(nut: NodeUnderTest) -> FaultResult:
    """The endpoint's port closes (connections refused) and opens again: S3 jobs fail
    fast, the breaker opens, and closes again on the first request that gets through."""
    with FaultRun(nut, "S3 endpoint stopped, restarted") as run:
        failed = _s3_failures(nut)
        run.inject(nut.proxy.down)
        run.detected(lambda: _s3_failures(nut) > failed)
        time.sleep(nut.rng.uniform(1.0, 3.0))
        grown = _s3_stores_grow(nut)
        nut.proxy.up()
        run.recovered(lambda: grown() and nut.peer_ready("tier", "s3"), timeout=90)
    return run.check()


def s3_endpoint_hang(nut: NodeUnderTest, hang_s: float = 5.0) -> FaultResult:
    """The endpoint process is stopped: connections are accepted, nothing answers.
    Requests time out (read_timeout_s); a job past its deadline fences the tier."""
    assert nut.s3 is not None
    moto = nut.s3.pid
    with FaultRun(nut, f"S3 endpoint hung {hang_s:.0f}s") as run:
        failed = _s3_failures(nut)
        with stopped(nut.node, moto):
            run.inject(lambda: None)
            run.maybe_detected(lambda: _s3_failures(nut) > failed, hang_s)
        grown = _s3_stores_grow(nut)
        run.recovered(lambda: grown() and nut.peer_ready("tier", "s3"), timeout=90)
    return run.check()


def s3_slow(nut: NodeUnderTest, delay_s: float = 0.25, for_s: float = 4.0) -> FaultResult:
    """Every chunk the endpoint sends back arrives `delay_s` late, for `for_s`: jobs
    succeed late or fail by their deadline; no client call waits past its own."""
    with FaultRun(nut, f"S3 I/O slowed {delay_s}s/chunk") as run:
        failed = _s3_failures(nut)
        run.inject(lambda: setattr(nut.proxy, "delay_s", delay_s))
        run.maybe_detected(lambda: _s3_failures(nut) > failed, for_s)
        nut.proxy.delay_s = 0.0
        grown = _s3_stores_grow(nut)
        run.recovered(lambda: grown() and nut.peer_ready("tier", "s3"), timeout=90)
    return run.check()


def disk_stalls(nut: NodeUnderTest, for_s: float = 4.0) -> FaultResult:
    """Slow disk I/O: the disk tier stalls 0.3 s of every 0.5 s (stopped and continued),
    for `for_s`; each stall is shorter than 3 heartbeats, so it is slow, not dead."""
    old = nut.node.pid("tier:disk:0")
    with FaultRun(nut, "disk I/O stalls 0.3s of 0.5s") as run:
        def stalls() -> None:
            end = time.monotonic() + for_s
            while time.monotonic() < end:
                with stopped(nut.node, old):
                    time.sleep(0.3)
                time.sleep(0.2)

        run.inject(stalls)
        run.maybe_detected(lambda: nut.peer_listed(old) is False, 0.5)
        run.recovered(lambda: nut.peer_ready("tier", "disk"), timeout=90)
    return run.check()


SCENARIOS: dict[str, Callable[[NodeUnderTest], FaultResult]] = {
    **{f"{child} {sig}": (lambda nut, c=child, s=sig: peer_fault(nut, c, s))
       for child in PEERS for sig in SIGNALS},
    "broker SIGKILL": broker_kill,
    "broker SIGSTOP": broker_stop,
    "supervisor SIGKILL": supervisor_kill,
    "supervisor SIGSTOP": supervisor_stop,
    "S3 endpoint down": s3_endpoint_down,
    "S3 endpoint hang": s3_endpoint_hang,
    "S3 slow": s3_slow,
    "disk stalls": disk_stalls,
}


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("signame", list(SIGNALS))
@pytest.mark.parametrize("child", list(PEERS))
def test_worker_or_tier_fault_is_detected_fenced_and_restarted(ready, child, signame):
    peer_fault(ready, child, signame)


def test_broker_killed_is_restarted_and_peers_rejoin_with_what_they_hold(ready):
    broker_kill(ready)


def test_broker_hung_is_killed_and_restarted_and_costs_clients_no_deadline(ready):
    broker_stop(ready)


def test_supervisor_killed_children_stop_and_a_new_one_recovers_the_disk(ready):
    supervisor_kill(ready)


def test_supervisor_hung_the_node_serves_and_restarts_come_later(ready):
    supervisor_stop(ready)


def test_s3_endpoint_stopped_and_restarted(ready):
    s3_endpoint_down(ready)


def test_s3_endpoint_hung(ready):
    s3_endpoint_hang(ready)


def test_slow_s3_io(ready):
    s3_slow(ready)


def test_stalling_disk_io(ready):
    disk_stalls(ready)


def test_tiers_killed_repeatedly_at_random_points(ready):
    """Crashes and hangs of the tier processes, one after another, each as soon as
    the node serves again."""
    for _ in range(3):
        ready.wait(ready.all_ready, 90, "node ready")
        child = ready.rng.choice(["tier:disk:0", "tier:s3:0"])
        peer_fault(ready, child, ready.rng.choice(list(SIGNALS)))


@pytest.mark.slow
def test_every_fault_again_repeatedly_in_random_order(ready):
    """The figures of docs/reliability.md: every scenario TIERKV_FAULT_ROUNDS times
    (default 3), shuffled by the seed; TIERKV_FAULT_ONLY="broker SIGKILL,..." picks
    scenarios."""
    rounds = int(os.environ.get("TIERKV_FAULT_ROUNDS", "3"))
    only = [n.strip() for n in os.environ.get("TIERKV_FAULT_ONLY", "").split(",") if n.strip()]
    unknown = set(only) - set(SCENARIOS)
    assert not unknown, f"unknown scenarios {unknown}; known: {list(SCENARIOS)}"
    plan = [name for name in only or SCENARIOS for _ in range(rounds)]
    ready.rng.shuffle(plan)
    for name in plan:
        ready.proxy.delay_s = 0.0
        ready.wait(ready.all_ready, 120, f"node ready before {name}")
        SCENARIOS[name](ready)
