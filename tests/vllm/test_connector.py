"""vLLM 0.33's real Scheduler and OffloadingConnector (both roles) on CPU KV tensors,
offloading into a real tierkv node (broker and disk tier processes).

Every engine step the stand-in model checks that each block vLLM counts as computed
holds the bytes of its own hash (`Engine.mismatches`), so a load that delivers the
wrong bytes — from the CPU tier, or promoted back from disk — fails these tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.vllm.conftest import (
    SHAPE,
    chunk_keys,
    extra_config,
    manager_of,
    node_statuses,
    request,
)
from tierkv.bench.vllm_engine import Engine
from tierkv.client import Client
from tierkv.core.shm import RegionError, SharedRegion
from tierkv.vllm.layout import NodeMismatch

DOC_BLOCKS = 12  # a shared prefix: 12 GPU blocks of 16 tokens
REPO = Path(__file__).resolve().parents[2]


def documents(n: int, start: int = 0) -> list[list[int]]:
    return [[100 + (start + d) * 1000 + i for i in range(DOC_BLOCKS * SHAPE.block_size)]
            for d in range(n)]


def run_round(engine: Engine, docs: list[list[int]], tag: int) -> None:
    """Every document once, each with its own short suffix, to the end."""
    for doc in docs:
        engine.add(doc + [7, 8, tag], max_tokens=2)
    engine.run()


def serve_rounds(engine: Engine, docs: list[list[int]], rounds: int = 3) -> Engine:
    """Every document `rounds` times, then the engine closed; returns it to check."""
    try:
        for tag in range(rounds):
            run_round(engine, docs, tag)
    finally:
        engine.close()
    return engine


def node_stats(node) -> dict:
    with Client.from_config(node.config) as c:
        return c.stats()


def test_kv_is_stored_evicted_to_disk_promoted_and_loaded_back_byte_exact(start_node):
    # 8 documents x 12 blocks = 96 blocks: more than the GPU (48) and the CPU tier
    # (32) hold, so later rounds are served by the CPU tier and by promotions from disk.
    node = start_node(cpu_blocks=32)
    engine = serve_rounds(Engine(SHAPE, extra_config(node)),
                          documents(8))
    assert engine.mismatches == []
    assert engine.tokens["external_hits"] >= 4 * DOC_BLOCKS * SHAPE.block_size
    stats = node_stats(node)
    assert stats["tiering"]["promotions_landed"] > 0  # some hits came back from disk
    assert stats["tiering"]["promotions_failed"] == 0


def test_the_byte_check_catches_a_corrupted_cpu_tier(start_node, instance):
    """The negative control of the check above: the same run with the CPU tier's
    bytes overwritten between rounds reports mismatches."""
    # Room in the CPU tier for every block (72) and the engine's spare rows, so
    # that round 1's hits are the overwritten rows, not promotions from disk.
    node = start_node(cpu_blocks=128)
    engine = Engine(SHAPE, extra_config(node))
    try:
        docs = documents(6)
        run_round(engine, docs, 0)
        with SharedRegion.attach(instance) as region:
            np.asarray(region.numpy())[:] = 0x5A
        run_round(engine, docs, 1)
    finally:
        engine.close()
    assert engine.tokens["external_hits"] > 0
    assert engine.mismatches


def two_engines_one_after_the_other(node: Any, order_copies: bool = True,
                                    **options: Any) -> tuple[Engine, Engine]:
    """Two engines on one node, the second serving the documents the first computed;
    the first never read a wrong byte (the caller checks the second's)."""
    first = Engine(SHAPE, extra_config(node, **options), name="a", order_copies=order_copies)
    second = Engine(SHAPE, extra_config(node, **options), name="b")
    try:
        docs = documents(4)
        run_round(first, docs, 0)
        run_round(second, docs, 1)
    finally:
        first.close()
        second.close()
    assert first.mismatches == []
    return first, second


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "race"])
def test_copies_submitted_while_the_model_still_writes_store_its_final_bytes(
        start_node, ordered):
    """vLLM submits a step's transfers after it launched the forward pass; here the
    stand-in model is still writing (half of each new block) on its own thread when
    every transfer is submitted. The copies wait for tierkv's CPU ordering point, so
    every block stored holds the model's final bytes: a second engine loads every one
    of them back and checks it byte for byte. The negative control takes the ordering
    away (and lets the copies run first): the half-written blocks are stored."""
    first, second = two_engines_one_after_the_other(start_node(cpu_blocks=128), ordered)
    assert first.tokens["copies_submitted_mid_forward"] > 0
    # Every full block of every document but the GPU-cached tail came from tierkv.
    assert second.tokens["external_hits"] >= 4 * (DOC_BLOCKS - 1) * SHAPE.block_size
    if ordered:
        assert second.mismatches == []
    else:
        assert second.mismatches


def test_two_engines_share_one_node(start_node):
    """A prefix one engine stored is a hit for another engine on the same node (vLLM's
    own offloading keeps each engine's CPU cache to itself)."""
    first, second = two_engines_one_after_the_other(start_node(cpu_blocks=128))
    assert second.mismatches == []
    assert first.tokens["external_hits"] == 0
    # Every full block of every document but the GPU-cached tail was served by tierkv.
    assert second.tokens["external_hits"] >= 4 * (DOC_BLOCKS - 1) * SHAPE.block_size


def test_a_tier_killed_mid_run_costs_hits_never_correctness(start_node):
    node = start_node(cpu_blocks=32)
    engine = Engine(SHAPE, extra_config(node))
    try:
        docs = documents(8)
        run_round(engine, docs, 0)
        for doc in docs:
            engine.add(doc + [7, 8, 1], max_tokens=2)
        # Until lookups started promotions from disk: bounded in time, not in steps (a
        # loaded machine answers the scheduler's lookups some steps later).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            engine.step()
            if node_stats(node)["tiering"]["promotions_started"]:
                break
            time.sleep(0.01)
        assert node_stats(node)["tiering"]["promotions_started"] > 0
        node.kill("tier:disk:0")
        engine.run(timeout_s=120)  # promotions in flight fail after broker.job_timeout_s
        run_round(engine, docs, 2)
    finally:
        engine.close()
    assert engine.mismatches == []
    assert not engine.scheduler.has_unfinished_requests()


def test_a_broker_that_is_gone_means_recompute_not_a_hang(start_node):
    node = start_node(cpu_blocks=64)
    engine = Engine(SHAPE, extra_config(node, timeout_s=0.5))
    try:
        docs = documents(4)
        run_round(engine, docs, 0)
        node.kill("broker")
        run_round(engine, docs, 1)  # bounded: each request waits one timeout at most
    finally:
        engine.close()
    assert engine.mismatches == []
    assert not engine.scheduler.has_unfinished_requests()


def test_a_node_that_does_not_fit_the_engine_is_refused_naming_the_setting(start_node):
    node = start_node(page_size=SHAPE.page_size // 2)
    with pytest.raises(NodeMismatch, match=f"cpu.page_size={SHAPE.page_size}"):
        Engine(SHAPE, extra_config(node))


def test_an_engine_without_a_node_says_so(tmp_path):
    config = {"spec_name": "TierkvOffloadingSpec", "spec_module_path": "tierkv.vllm",
              "tierkv_instance": "tnonode", "tierkv_address": f"ipc://{tmp_path}/c.sock"}
    with pytest.raises(RegionError, match="is the broker of instance 'tnonode' running"):
        Engine(SHAPE, config)


def test_chunks_of_two_gpu_blocks_are_stored_and_loaded_byte_exact(start_node):
    """vLLM's `block_size` of 32 tokens: an offloaded chunk is two 16-token GPU blocks,
    one tierkv block of two pages (stored, found and evicted whole); partial chunks at
    a request's edges are skipped or split."""
    node = start_node(cpu_blocks=32, cpu={"world_size": 2})
    engine = serve_rounds(Engine(SHAPE, extra_config(node, block_size=2 * SHAPE.block_size)),
                          documents(6))
    assert engine.mismatches == []
    assert engine.tokens["external_hits"] >= 2 * DOC_BLOCKS * SHAPE.block_size


def test_every_lookup_can_wait_for_the_end_of_step_round_trip(start_node):
    """`sync_lookups` 0: no lookup has a round trip of its own; each request is told
    RETRY once and served from the end-of-step answers."""
    first, second = two_engines_one_after_the_other(start_node(cpu_blocks=128),
                                                    sync_lookups=0)
    assert second.mismatches == []
    assert second.tokens["external_hits"] >= 4 * (DOC_BLOCKS - 1) * SHAPE.block_size


def test_a_hybrid_model_offloads_both_kv_cache_groups(start_node):
    """Full-attention and sliding-window layers in two KV-cache groups: vLLM's keys of
    both groups are tierkv blocks, its sliding-window lookups use the per-key status,
    and every block of both groups is checked."""
    shape = replace(SHAPE, gpu_blocks=64, sliding_window=4 * SHAPE.block_size)
    node = start_node(cpu_blocks=64)
    engine = serve_rounds(Engine(shape, extra_config(node)),
                          documents(6))
    assert engine.mismatches == []
    assert engine.tokens["external_hits"] >= 4 * DOC_BLOCKS * SHAPE.block_size


def test_after_reset_cache_an_engine_is_served_no_block_stored_before_it(start_node):
    """vLLM's weight-update path resets its caches: blocks stored before are never
    this engine's hits again; an engine that did not reset still shares them."""
    node = start_node(cpu_blocks=256)
    resetting = Engine(SHAPE, extra_config(node), name="a")
    other = Engine(SHAPE, extra_config(node), name="b")
    try:
        docs = documents(8)  # more than the GPU holds: repeats come from tierkv
        run_round(resetting, docs, 0)
        run_round(resetting, docs, 1)
        assert resetting.tokens["external_hits"] > 0
        resetting.reset()
        before = resetting.tokens["external_hits"]
        run_round(resetting, docs, 2)
        assert resetting.tokens["external_hits"] == before
        run_round(other, docs, 3)
        assert other.tokens["external_hits"] >= 4 * DOC_BLOCKS * SHAPE.block_size
        run_round(resetting, docs, 4)  # what it stored since the reset is its own
        assert resetting.tokens["external_hits"] > before
    finally:
        resetting.close()
        other.close()
    assert resetting.mismatches == [] and other.mismatches == []


@pytest.mark.parametrize("direction", ["load", "store"])
def test_a_copy_that_fails_is_recomputed_and_never_served(start_node, direction):
    """A failed load: vLLM recomputes its blocks (its connector failure path). A
    failed store: a miss, never a hit on rows nobody wrote (the second engine would
    read them)."""
    node = start_node(cpu_blocks=256)
    # GPU room for every request's blocks at once: lookups answered before the first
    # step admit all four together, and vLLM 0.33 stops admitting at the head of its
    # queue of requests holding blocks when the recomputed one cannot have its blocks
    # (it counts the in-flight loads' blocks as reserved again): a deadlock of a GPU
    # too small for its concurrent loads, not of the failure path tested here.
    shape = replace(SHAPE, gpu_blocks=96)
    first = Engine(shape, extra_config(node), name="a")
    second = Engine(shape, extra_config(node), name="b")
    try:
        docs = documents(4)
        if direction == "store":
            first.fail_copies("store", 2)
        run_round(first, docs, 0)
        if direction == "load":
            second.fail_copies("load", 2)
        run_round(second, docs, 1)
    finally:
        first.close()
        second.close()
    assert first.tokens[f"failed_{direction}s"] + second.tokens[f"failed_{direction}s"] == 2
    assert first.mismatches == [] and second.mismatches == []
    assert not second.scheduler.has_unfinished_requests()
    assert second.tokens["external_hits"] > 0


def test_a_broker_that_stops_answering_never_holds_a_scheduler_step(start_node):
    """The broker stopped (SIGSTOP: its socket is there, nothing answers) with
    `timeout_s` far past the round's deadline: had any call of vLLM's scheduler
    thread waited for it beyond `budget_ms`, the round could not finish in time.
    Lookups answer RETRY, then miss after `lookup_wait_ms`; stores are offered
    again; the requests are computed."""
    node = start_node(cpu_blocks=128)
    engine = Engine(SHAPE, extra_config(node, budget_ms=2.0, lookup_wait_ms=50.0,
                                        timeout_s=300.0))
    try:
        docs = documents(4)
        run_round(engine, docs, 0)
        node.kill("broker", signal.SIGSTOP)
        try:
            for doc in docs:
                engine.add(doc + [7, 8, 1], max_tokens=2)
            engine.run(timeout_s=60.0)
        finally:
            node.kill("broker", signal.SIGCONT)
        run_round(engine, docs, 2)  # and back to normal
    finally:
        engine.close()
    assert engine.mismatches == []
    assert not engine.scheduler.has_unfinished_requests()


def test_requests_sharing_prefixes_admitted_together_preempted_and_aborted(start_node):
    """vLLM's real load: many requests of a few prefixes admitted in one step (each
    offers the shared chunks again), a GPU too small for them all (preemptions: a
    preempted request is looked up and loaded again), and clients that go away."""
    node = start_node(cpu_blocks=256)
    shape = replace(SHAPE, gpu_blocks=40, max_num_seqs=16)
    engine = Engine(shape, extra_config(node))
    try:
        docs = documents(3)
        ids = [engine.add(doc + [7, 8, i], max_tokens=24) for i in range(5) for doc in docs]
        for _ in range(100):  # bounded: until vLLM ran out of GPU blocks and preempted
            engine.step()
            if engine.tokens["preemptions"]:
                break
        engine.abort(ids[::4])
        engine.run(timeout_s=120)
        run_round(engine, documents(3), 9)
    finally:
        engine.close()
    assert engine.mismatches == []
    assert engine.tokens["preemptions"] > 0
    assert engine.tokens["external_hits"] > 0
    assert not engine.scheduler.has_unfinished_requests()


ENGINE_PROCESS = """
import sys, time
from tierkv.bench.vllm_engine import Engine, EngineShape
shape = EngineShape(gpu_blocks={gpu_blocks})
engine = Engine(shape, {extra!r}, name="doomed")
for doc in {docs!r}:
    engine.add(doc + [7, 8, 0], max_tokens=2)
writing = engine.scheduler.connector.connector_scheduler.manager.holdings.writing
while not writing:
    engine.step()  # until a step reserved rows for its stores: the copies come next
print(" ".join(k.hex() for held in writing.values() for k in held.keys), flush=True)
time.sleep(600)
"""


def test_an_engine_killed_mid_store_leaves_the_other_engine_going(start_node, tmp_path):
    """An engine process SIGKILLed with rows reserved for its stores (their chunks
    pending for everyone): the broker ends it after `broker.owner_timeout_s`, its
    chunks are misses again (never pending for ever, never a hit on rows nobody
    wrote), and a second engine on the same node computes and stores them, and a
    third is served them."""
    node = start_node(cpu_blocks=256, broker={"owner_timeout_s": 1.0})
    docs = documents(4)
    script = ENGINE_PROCESS.format(gpu_blocks=SHAPE.gpu_blocks, docs=docs,
                                   extra=extra_config(node))
    doomed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert doomed.stdout is not None
        reserved = [bytes.fromhex(k) for k in doomed.stdout.readline().split()]
        doomed.kill()
        doomed.wait(timeout=30)
        assert reserved and set(node_statuses(node, reserved)) == {"pending"}
        # Pending until the broker ends the dead engine, then computed and stored.
        survivor = serve_rounds(Engine(SHAPE, extra_config(node), name="survivor"), docs, 1)
        reader = serve_rounds(Engine(SHAPE, extra_config(node), name="reader"), docs, 1)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(timeout=30)
    assert survivor.mismatches == [] and reader.mismatches == []
    assert reader.tokens["external_hits"] >= 4 * (DOC_BLOCKS - 1) * SHAPE.block_size
    assert set(node_statuses(node, reserved)) == {"hit"}


def test_a_node_whose_rows_cannot_hold_a_whole_chunk_is_refused(start_node):
    with pytest.raises(NodeMismatch, match="cpu.world_size=2"):
        Engine(SHAPE, extra_config(start_node(cpu_blocks=8), block_size=2 * SHAPE.block_size))


def test_a_chunk_of_several_gpu_blocks_is_one_block_of_the_node(start_node):
    """A chunk is stored, found and evicted whole (a half chunk is worth nothing to a
    prefix lookup): one row holds every GPU block of it."""
    node = start_node(cpu_blocks=8, cpu={"world_size": 2})
    engine = Engine(SHAPE, extra_config(node, block_size=2 * SHAPE.block_size), copy=False)
    try:
        manager = manager_of(engine)
        chunks = chunk_keys(3)
        with manager.lock:
            out = manager.prepare_store(chunks, request("r", chunks, tokens_per_chunk=32))
        assert out.keys_to_store == chunks
        assert out.store_spec.rows.tolist() == sorted(set(out.store_spec.rows.tolist()))
        assert len(out.store_spec.rows) == 3  # one row per chunk
        assert node_statuses(node, manager.keymap.keys(chunks)) == ["pending"] * 3
    finally:
        engine.close()


def test_a_ranks_failed_stores_survive_vllms_merge_of_the_ranks_metadata():
    """Under tensor parallelism vLLM merges every rank's worker metadata with the
    first one's `aggregate`: a store one rank could not write is aborted, whichever."""
    from tierkv.vllm.connector import TierkvWorkerMetadata

    merged = TierkvWorkerMetadata({7: 1}).aggregate(
        TierkvWorkerMetadata({7: 1}, failed_stores={7}))
    assert isinstance(merged, TierkvWorkerMetadata)
    assert merged.completed_jobs == {7: 2} and merged.failed_stores == {7}


def test_a_steps_copies_reach_the_copy_engine_as_one_batch_per_direction(
        start_node, monkeypatch):
    """vLLM submits a step's transfers job by job: tierkv hands them to its copy
    engine as one job per direction, not one launch per vLLM job."""
    from workers.gpu.transfer import TransferEngine

    node = start_node(cpu_blocks=256)
    engine = Engine(SHAPE, extra_config(node))
    launches: list[tuple[int, str]] = []
    submit = TransferEngine.submit
    monkeypatch.setattr(TransferEngine, "submit", lambda self, job: (
        launches.append((engine.steps, job.direction)), submit(self, job))[1])
    worker = engine.worker.connector_worker.worker
    jobs: list[tuple[int, str]] = []
    for direction in ("load", "store"):
        counted = getattr(worker, f"submit_{direction}")
        monkeypatch.setattr(worker, f"submit_{direction}", lambda *args, d=direction, c=counted: (
            jobs.append((engine.steps, d)), c(*args))[1])
    try:
        docs = documents(6)
        run_round(engine, docs, 0)
        run_round(engine, docs, 1)
    finally:
        engine.close()
    assert engine.mismatches == []
    assert len(jobs) > len(launches) > 0
    assert len(launches) == len(set(launches))  # at most one per step and direction
