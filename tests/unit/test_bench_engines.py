"""`tierkv bench engines`: reading a process's CPU time from /proc, the broker's CPU
per engine step, the rows made of given windows, and a tiny run end to end (N=1, 2;
~25 s on two cores, most of it each engine process importing vLLM) that leaves no
process and no shared memory behind. No timing is asserted."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from tierkv.bench import OPT_IN, PART_BUDGETS, select_parts
from tierkv.bench.common import FLAT, Budget, Part
from tierkv.bench.engines import (
    CpuReading,
    Window,
    read_cpu,
    rows,
    schedstat_seconds,
    stat_cpu_seconds,
    workload,
)

# A /proc/<pid>/stat line whose name holds a space and a ')': utime 250, stime 50.
STAT = ("4242 (py thon) x) S 1 4242 4242 0 -1 4194560 9000 0 0 0 250 50 0 0 20 0 5 0 "
        "12345 100000000 5000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0")


def test_stat_is_read_past_the_name_in_clock_ticks() -> None:
    assert stat_cpu_seconds(STAT, 100) == pytest.approx(3.0)
    assert stat_cpu_seconds(STAT, 250) == pytest.approx(1.2)


def test_schedstat_is_nanoseconds_on_a_cpu() -> None:
    assert schedstat_seconds("1500000000 20000 7\n") == pytest.approx(1.5)


def test_this_process_cpu_is_read_and_grows() -> None:
    before = read_cpu(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    after = read_cpu(os.getpid())
    assert after.ticks >= before.ticks
    assert after.best() > before.best()
    assert CpuReading(1.0, None).best() == 1.0


def window(repeat: int, engines: int, cpu_s: float, median_s: float = 0.002) -> Window:
    return Window(repeat, engines, [median_s] * engines, steps=100, broker_cpu_s=cpu_s,
                  broker_cpu_ticks_s=cpu_s, wall_s=1.0, broker_requests=engines * 150)


def test_broker_cpu_per_engine_step_divides_by_every_engines_steps() -> None:
    w = window(0, 4, cpu_s=0.08)
    assert w.engine_steps == 400
    assert w.cpu_per_step == pytest.approx(0.0002)
    assert w.median_step == pytest.approx(0.002)


def test_rows_pair_each_n_with_n1_of_the_same_repeat() -> None:
    windows = [window(0, 1, 0.010), window(0, 2, 0.024), window(0, 8, 0.096, 0.008),
               window(1, 1, 0.020), window(1, 2, 0.040)]
    made = {r.name: r for r in rows(windows, requests=64)}
    assert len(made) == 6
    cpu8 = made["broker CPU per engine step, 8 engines"]
    # 0.096 s / 800 steps = 120 us against 0.010 s / 100 steps = 100 us.
    assert cpu8.value.median == pytest.approx(120.0)
    assert cpu8.ratio is not None and cpu8.ratio.median == pytest.approx(1.2)
    assert cpu8.want == FLAT and "(met)" in cpu8.note
    cpu2 = made["broker CPU per engine step, 2 engines"]
    assert cpu2.ratio is not None and cpu2.ratio.n == 2  # both repeats paired
    assert sorted([cpu2.ratio.min, cpu2.ratio.max]) == pytest.approx([1.0, 1.2])
    step8 = made["engine step, 8 engines on one broker"]
    assert step8.ratio is not None and step8.ratio.median == pytest.approx(4.0)
    assert step8.headline and not made["engine step, 2 engines on one broker"].headline
    cpu1 = made["broker CPU per engine step, 1 engine"].ratio
    assert cpu1 is not None and cpu1.median == pytest.approx(1.0)


def test_a_goal_missed_at_8_engines_says_so() -> None:
    made = rows([window(0, 1, 0.010), window(0, 8, 0.160)], requests=64)
    assert "(missed)" in made[-1].note
    assert rows([], requests=64) == []


def test_the_part_is_opt_in_and_runs_the_queued_hits_workload() -> None:
    assert "engines" in OPT_IN and PART_BUDGETS["engines"] > 0
    assert "engines" not in select_parts([]) and select_parts(["engines"]) == ["engines"]
    w = workload(quick=True)
    assert w.cycle and w.gpu_cache_blocks == 0 and w.queued == w.requests // 4


def _children() -> set[int]:
    """Pids whose parent is this process."""
    mine = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                mine.add(int(entry))
    return mine


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM 0.33")
def test_two_engines_on_one_broker_end_to_end_leave_nothing_behind() -> None:
    from dataclasses import replace

    from tierkv.bench.engines import run_engines
    from tierkv.bench.vllm import Workload

    children_before = _children()
    work = replace(Workload(requests=16, steps=5, warmup=3).tierkv_hits(), queued=4)
    part = Part("engines", Budget(300.0))
    windows = run_engines(part, [1, 2], work, repeats=1)
    assert [w.engines for w in windows] == [1, 2]
    assert all(w.steps == 5 and len(w.medians) == w.engines for w in windows)
    assert all(w.broker_cpu_s >= 0 and w.broker_requests > 0 for w in windows)
    assert len(part.rows) == 6 and not part.skipped
    # Other runs on the host may hold segments of their own: only this run's nodes'.
    instances = {w.instance for w in windows}
    assert all(instances) and len(instances) == 2
    assert not [s for s in os.listdir("/dev/shm") if any(i in s for i in instances)]
    assert _children() <= children_before
