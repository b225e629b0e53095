"""`realtime_priority`: the broker's threads, and a client's thread while it waits,
in SCHED_RR; refused cleanly where the process may not; checked in the config."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest

from tierkv.node.config import ConfigError, config_from_dict
from tierkv.node.realtime import WaitBoost, allowed, check_priority, enter_realtime

RT = (os.SCHED_RR, os.SCHED_FIFO)
needs_rt = pytest.mark.skipif(not allowed(1), reason="this process may not use SCHED_RR "
                              "(CAP_SYS_NICE or `ulimit -r 1`)")


def policy(tid: int = 0) -> int:
    return os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK


def on_thread(fn):  # noqa: ANN001, ANN201
    """Run `fn` on a thread of its own (whatever it does to its class ends with it)."""
    out: list = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001
            error.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    if error:
        raise error[0]
    return out[0]


@pytest.mark.parametrize("value", [-1, 100, True, 1.5, "1"])
def test_a_priority_outside_0_to_99_is_refused_naming_the_key(value, tmp_path):
    assert check_priority(value) is not None
    for side in ("broker", "client"):
        with pytest.raises(ConfigError, match=f"{side}.realtime_priority"):
            config_from_dict({"instance": "rt", "run_dir": str(tmp_path),
                              side: {"realtime_priority": value}}, "<test>")


def test_priorities_0_to_99_are_accepted(tmp_path):
    for value in (0, 1, 99):
        config = config_from_dict({"instance": "rt", "run_dir": str(tmp_path),
                                   "broker": {"realtime_priority": value},
                                   "client": {"realtime_priority": value}}, "<test>")
        assert config.broker.realtime_priority == config.client.realtime_priority == value


@needs_rt
def test_a_waiting_thread_is_lifted_for_the_wait_only_and_nested_waits_undo_once():
    boost = WaitBoost(1)

    def run() -> list[int]:
        seen = [policy()]
        with boost:
            seen.append(policy())
            with boost:
                seen.append(policy())
            seen.append(policy())  # the inner wait did not put it back early
        seen.append(policy())
        return seen

    assert on_thread(run) == [os.SCHED_OTHER, os.SCHED_RR, os.SCHED_RR, os.SCHED_RR,
                              os.SCHED_OTHER]


@needs_rt
def test_a_thread_already_real_time_is_left_as_it_is():
    def run() -> tuple[int, int]:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(3))
        with WaitBoost(1):
            pass
        return policy(), os.sched_getparam(0).sched_priority

    assert on_thread(run) == (os.SCHED_FIFO, 3)


@needs_rt
def test_a_lifted_thread_does_not_pass_the_class_to_a_process_it_starts():
    def run() -> str:
        with WaitBoost(1):
            return subprocess.run(
                [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                capture_output=True, text=True, timeout=30, check=True).stdout.strip()

    assert int(on_thread(run)) == os.SCHED_OTHER


@needs_rt
def test_enter_realtime_lifts_every_thread_of_the_process():
    code = ("import os, threading, time\n"
            "from tierkv.node.realtime import enter_realtime\n"
            "stop = threading.Event()\n"
            "t = threading.Thread(target=stop.wait); t.start()\n"
            "assert enter_realtime(2, 'test')\n"
            "print(sorted({os.sched_getscheduler(int(x)) & ~os.SCHED_RESET_ON_FORK "
            "for x in os.listdir('/proc/self/task')}))\n"
            "stop.set(); t.join()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert out.strip() == f"[{os.SCHED_RR}]"


def test_zero_changes_nothing():
    def run() -> tuple[bool, int, int]:
        before = policy()
        with WaitBoost(0):
            during = policy()
        return enter_realtime(0, "test"), before, during

    assert on_thread(run) == (False, os.SCHED_OTHER, os.SCHED_OTHER)


SETPRIV = shutil.which("setpriv")


@pytest.mark.skipif(SETPRIV is None or shutil.which("prlimit") is None or os.geteuid() != 0,
                    reason="needs setpriv and root, to run a process without CAP_SYS_NICE")
def test_a_process_not_allowed_the_class_says_so_once_and_goes_on():
    code = ("import logging, os\n"
            "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
            "from tierkv.node.realtime import WaitBoost, enter_realtime\n"
            "assert not enter_realtime(1, 'broker')\n"
            "boost = WaitBoost(1)\n"
            "for _ in range(3):\n"
            "    with boost:\n"
            "        assert os.sched_getscheduler(0) == os.SCHED_OTHER\n"
            "from tierkv.client import Client\n"
            "Client('ipc:///nonexistent/client.sock', realtime_priority=1).close()\n"
            "print('went on')\n")
    # Without CAP_SYS_NICE, and an RLIMIT_RTPRIO of 0: as an unprivileged user.
    done = subprocess.run([SETPRIV, "--bounding-set=-sys_nice", "prlimit", "--rtprio=0",
                           sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "went on"
    warnings = [line for line in done.stderr.splitlines() if "realtime_priority" in line]
    assert len(warnings) == 2, done.stderr  # the broker's, and the client's once
    # (its context's threads were not asked for the class: libzmq would abort)
    assert all("ulimit -r" in line for line in warnings)
