"""The broker's store path in process: which GPU block each accepted key's job
names (keys repeated, or held already), and when a client waiting for the job
hears of it against when its blocks become ready."""

from __future__ import annotations

import os
from pathlib import Path

from broker.core import BrokerCore, _gpu_ids_of
from tests.integration.cluster import make_config
from tierkv.core.primary import PrimaryTier
from tierkv.core.shm import process_start_time
from tierkv.core.tiering import TieringManager
from tierkv.engine import KVLayout, allocate_kv_cache
from tierkv.node.children import ChildRegistry
from tierkv.wire.protocol import (
    AttachedKV,
    AttachKV,
    OpsRequest,
    RegisterKVRequest,
    Reply,
    TransferBatch,
    TransferDoneBatch,
    TransferOutcome,
    WorkerHello,
)


def k(*ns: int) -> list[bytes]:
    return [n.to_bytes(8, "big") for n in ns]


def test_gpu_ids_of_accepted_keys():
    keys, gpu = k(1, 2, 3), [7, 8, 9]
    assert _gpu_ids_of(keys, gpu, keys) is gpu  # all accepted: no copy, no dict
    assert _gpu_ids_of(keys, gpu, k(1, 3)) == [7, 9]
    # a repeated key: the dict's (last) id, as before
    assert _gpu_ids_of(k(1, 2, 1), [7, 8, 5], k(1, 2)) == [5, 8]


def node(tmp_path: Path, instance: str, sent: list[object]) -> BrokerCore:
    """A broker core with a CPU worker for rank 0 and a KV cache client b"c" made."""
    config = make_config("store", tmp_path, tiers=[])
    core = BrokerCore(config, TieringManager(PrimaryTier(16, "lru")), {},
                      lambda link, identity, msg: sent.append(msg) or True)
    pid = os.getpid()
    token = ChildRegistry.new_token()
    ChildRegistry(tmp_path).add(token, "worker0", pid)  # as the supervisor records it
    core.on_worker(b"w0", WorkerHello(0, 1, pid, process_start_time(pid) or 0, token=token))
    layout = KVLayout.per_layer(2, 16, 4, 2, 8, "float16")
    with allocate_kv_cache(instance, 0, layout) as kv:
        core.on_client(b"c", RegisterKVRequest(1, 0, kv.registration()))
        attach = next(m for m in sent if isinstance(m, AttachKV))
        core.on_worker(b"w0", AttachedKV(attach.reg_id, True, page_size=layout.page_size))
    return core


def test_a_store_job_names_the_gpu_block_of_each_accepted_key(tmp_path: Path, instance):
    sent: list[object] = []
    core = node(tmp_path, instance, sent)

    def job(keys: list[bytes], gpu: list[int]) -> tuple[list[bytes], list[int]]:
        sent.clear()
        job_id, taken, refused = core.store(b"c", keys, gpu, None, [])
        assert job_id is not None and not refused
        (batch,) = [m for m in sent if isinstance(m, TransferBatch)]
        return taken, batch.jobs[0].gpu_block_ids

    assert job(k(1, 2, 3), [4, 5, 6]) == (k(1, 2, 3), [4, 5, 6])
    assert job(k(2, 7, 8), [10, 11, 12]) == (k(7, 8), [11, 12])  # 2 is being written
    assert job(k(9, 9, 10), [1, 2, 3]) == (k(9, 10), [2, 3])


def test_a_waiting_client_hears_first_and_no_request_sees_the_blocks_before_ready(
        tmp_path: Path, instance):
    """The answer to a client waiting for a store goes out as the completion
    arrives; the blocks become ready before the broker reads anything else."""
    sent: list[object] = []
    core = node(tmp_path, instance, sent)
    keys = k(1, 2, 3)
    job_id, _, _ = core.store(b"c", keys, [0, 1, 2], None, [])
    assert job_id is not None
    core.on_client(b"c", OpsRequest(7, step=True, wait=[job_id], wait_s=30.0))
    assert not any(isinstance(m, Reply) and m.id == 7 for m in sent)  # waits
    ready_when_answered: list[bool] = []
    send = core._send

    def watching(link: str, identity: bytes, msg: object) -> bool:
        if isinstance(msg, Reply) and msg.id == 7:
            ready_when_answered.append(core.manager.primary.is_ready(keys[0]))
        return send(link, identity, msg)

    core._send = watching  # type: ignore[method-assign]
    core.on_worker(b"w0", TransferDoneBatch([TransferOutcome(job_id, True)]))
    assert ready_when_answered == [False]  # answered first...
    (reply,) = [m for m in sent if isinstance(m, Reply) and m.id == 7]
    assert [(r.job_id, r.success) for r in reply.result.finished] == [(job_id, True)]
    assert all(core.manager.primary.is_ready(key) for key in keys)  # ...ready on return
    assert core.manager.primary.lookup(keys) == 3
    assert core.counters["outcome_errors"] == 0


def test_a_job_whose_blocks_cannot_be_released_is_still_answered(tmp_path: Path, instance):
    """A bug in the bookkeeping after a job costs that job's blocks, counted and
    logged; its client still hears the job's own result."""
    sent: list[object] = []
    core = node(tmp_path, instance, sent)
    job_id, _, _ = core.store(b"c", k(1, 2), [0, 1], None, [])
    assert job_id is not None
    core.on_client(b"c", OpsRequest(8, step=True, wait=[job_id], wait_s=30.0))
    core.manager.primary.complete_store(k(1, 2), False)  # freed behind its back: a bug
    core.on_worker(b"w0", TransferDoneBatch([TransferOutcome(job_id, True)]))
    (reply,) = [m for m in sent if isinstance(m, Reply) and m.id == 8]
    assert [r.job_id for r in reply.result.finished] == [job_id]
    assert core.counters["outcome_errors"] == 1
    core.manager.check_invariants()


def test_a_group_larger_than_the_whole_cpu_tier_is_too_large_not_refused(
        tmp_path: Path, instance):
    """17 new blocks can never fit a 16-block tier, however much is evicted: the
    caller is told `too_large` (split it), not `refused` as for a tier full now."""
    from tierkv.core.errors import ErrorCode
    from tierkv.wire.keyblob import pack_counts
    from tierkv.wire.protocol import KeyGroups

    sent: list[object] = []
    core = node(tmp_path, instance, sent)
    keys = b"".join(k(*range(1, 18)))

    def ops(request_id: int, **sections: object) -> Reply:
        sent.clear()
        core.on_client(b"c", OpsRequest(request_id, keys, 8, b"", **sections))
        (reply,) = [m for m in sent if isinstance(m, Reply) and m.id == request_id]
        return reply

    reply = ops(1, reserve=KeyGroups(pack_counts([17])))
    assert [(e.section, e.code) for e in reply.result.errors] == [
        ("reserve", ErrorCode.TOO_LARGE.value)]
    assert "cpu.num_blocks = 16" in reply.result.errors[0].message
    assert reply.result.reserve_ok == b"\x00"
    reply = ops(2, store=KeyGroups(pack_counts([17])), store_gpu=b"\x00\x00\x00\x00" * 17)
    assert [(e.section, e.code) for e in reply.result.errors] == [
        ("store", ErrorCode.TOO_LARGE.value)]
    assert core.manager.primary.lookup(k(1)) == 0  # nothing allocated
    reply = ops(3, reserve=KeyGroups(pack_counts([8, 9])))  # 8 fit; 9 of 16 hits the quota
    assert [e.code for e in reply.result.errors] == [ErrorCode.QUOTA.value]
    assert reply.result.reserve_ok == b"\x01\x00"
