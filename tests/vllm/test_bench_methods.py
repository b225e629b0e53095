"""`tierkv bench vllm --by-method`: each manager call vLLM makes, timed per back end
(`tierkv.bench.vllm_methods`), on vLLM's own in-process manager."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.conftest import chunk_keys

pytest.importorskip("vllm.v1.kv_offload.cpu.manager",
                    reason="vLLM 0.33 is not installed (pip install 'tierkv[vllm]')")


def manager(nested: bool = False) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    class TouchLooksUp(CPUOffloadingManager):
        """A manager method that calls another: counted once, as the call vLLM made."""

        def touch(self, keys: Any, req_context: Any) -> None:
            for key in keys:
                self.lookup(key, req_context)
            super().touch(keys, req_context)

    return (TouchLooksUp if nested else CPUOffloadingManager)(num_chunks=8)


def test_only_the_attached_manager_s_calls_are_timed_and_only_while_counting():
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from tierkv.bench.vllm_methods import MethodTimes

    timed, other = manager(), manager()
    times = MethodTimes()
    times.attach(timed)
    ctx, keys = ReqContext(req_id="r"), chunk_keys(2)
    timed.lookup(keys[0], ctx)  # the warm-up: not counted
    times.counting = True
    for _ in range(3):
        timed.lookup(keys[0], ctx)
    timed.prepare_store(keys, ctx)
    other.lookup(keys[0], ctx)
    times.counting = False
    timed.lookup(keys[0], ctx)
    assert dict(times.calls) == {"lookup": 3, "prepare_store": 1}
    assert times.seconds["lookup"] > 0 and times.seconds["prepare_store"] > 0
    assert "lookup" not in vars(other)  # another instance, and the class, as they were
    assert not hasattr(CPUOffloadingManager.lookup, "__wrapped__")


def test_a_method_calling_another_counts_as_the_one_call_vllm_made():
    from vllm.v1.kv_offload.base import ReqContext

    from tierkv.bench.vllm_methods import MethodTimes, report

    timed = manager(nested=True)
    times = MethodTimes()
    times.attach(timed)
    times.counting = True
    timed.touch(chunk_keys(4), ReqContext(req_id="r"))
    assert dict(times.calls) == {"touch": 1}
    lines = report(times, MethodTimes(), steps=2)
    ms = f"{times.seconds['touch'] / 2 * 1e3:.3f}"
    assert lines[1].replace(" ", "") == f"touch{ms}(0.5)|0.000(0.0)"  # per step, of 2


def test_a_step_s_calls_are_its_own_and_the_gap_is_split_step_by_step():
    from vllm.v1.kv_offload.base import ReqContext

    from tierkv.bench.vllm_methods import MethodTimes, paired

    timed = manager()
    times = MethodTimes()
    times.attach(timed)
    times.counting = True
    ctx, keys = ReqContext(req_id="r"), chunk_keys(2)
    timed.lookup(keys[0], ctx)  # before the step (an add's): not the step's
    times.begin_step()
    timed.lookup(keys[0], ctx)
    times.end_step()
    times.begin_step()
    times.end_step()
    assert len(times.per_step) == 2 and times.per_step[1] == 0.0
    assert 0 < times.per_step[0] < times.seconds["lookup"]

    ours, theirs = MethodTimes(), MethodTimes()
    ours.per_step, theirs.per_step = [3e-3, 1e-3, 2e-3], [1e-3, 1e-3, 1e-3]
    line = paired([9e-3, 5e-3, 7e-3], ours, [5e-3, 5e-3, 4e-3], theirs)
    # Differences: steps 4, 0, 3 ms (median 3); calls 2, 0, 1 (median 1); the rest
    # 2, 0, 2 (median 2), which is not the difference of the two medians.
    assert "step +3.000 ms" in line and "manager calls +1.000 ms" in line
    assert "the rest +2.000 ms" in line
