"""The wire format: every message round-trips; anything malformed is a ProtocolError."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.core.errors import ErrorCode
from tierkv.core.keys import OffloadEvent
from tierkv.tiers.base import Job, JobKind, JobResult
from tierkv.wire.codec import _MESSAGES
from tierkv.wire.protocol import (
    MAX_KEYS,
    PROTOCOL_VERSION,
    AttachedKV,
    AttachKV,
    BatchRequest,
    BatchResult,
    Bye,
    ErrorInfo,
    EventBatch,
    FinishRequest,
    Heartbeat,
    Inventory,
    LoadRequest,
    LookupRequest,
    LookupResult,
    PollRequest,
    ProtocolError,
    Ready,
    Refused,
    RegisterKVRequest,
    Reply,
    StatsRequest,
    StepRequest,
    StepResult,
    StoreRequest,
    TierDoneBatch,
    TierHello,
    TierJobBatch,
    TierStats,
    TouchRequest,
    TransferBatch,
    TransferDoneBatch,
    TransferJob,
    TransferOutcome,
    TransferResult,
    Welcome,
    WorkerHello,
    decode,
    encode,
    peek_id,
    to_map,
    to_record,
)

K = [b"k" * 8, b"q" * 64]

EXAMPLES = [
    Reply(1, True, result={"hits": 2}),
    Reply(2, False, error=ErrorInfo("bad_request", "no")),
    Heartbeat(),
    Welcome("inst", 10, 4096, 2, 0.5, "ns"),
    Refused("rank taken"),
    Bye("stopping"),
    LookupRequest(3, K, "r1"),
    StoreRequest(4, K, [1, 2], None),
    LoadRequest(5, K, [3, 4], "r"),
    TouchRequest(6, K),
    FinishRequest(7, "r"),
    StepRequest(8),
    PollRequest(9),
    StatsRequest(10),
    BatchRequest(11, [to_map(LookupRequest(0, K))]),
    RegisterKVRequest(12, 0, {"device": "cpu", "tensors": [{"shm": "/x", "shape": [1, 2]}]}),
    WorkerHello(0, 2, 123, 456, "cpu"),
    TransferBatch([TransferJob(1, "store", [1, 2], [3, 4], 12.5)]),
    TransferDoneBatch([TransferOutcome(1, False, "timeout", "late", 10, 0.5)]),
    AttachKV(1, {"a": 1}),
    AttachedKV(1, True, "", 4096),
    TierHello("disk", "disk", 9, 1, False, 1 << 30, "ns", 3),
    Inventory(K, True),
    Ready(16),
    TierJobBatch([Job(1, tuple(K), (1, 2), JobKind.PROMOTION, "r")], [3.0]),
    TierDoneBatch([JobResult(1, False, (K[0],), 10, 0.1, ErrorCode.CORRUPT, "bad", (K[1],))], 2),
    TierStats({"blocks": 3, "breaker": "closed"}),
    EventBatch(1, 7, [OffloadEvent("stored", tuple(K), "cpu")]),
]


def test_every_message_type_has_an_example():
    assert {type(m).op for m in EXAMPLES} == set(_MESSAGES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.op)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_reply_records_round_trip():
    step = StepResult([TransferResult(1, "load", True)], [OffloadEvent("stored", (b"a",), "cpu")])
    reply = decode(encode(Reply(1, True, result=step)))
    assert to_record(StepResult, reply.result) == step
    batch = BatchResult([Reply(0, True, result=LookupResult(1, True))])
    back = to_record(BatchResult, decode(encode(Reply(2, True, result=batch))).result)
    assert to_record(LookupResult, back.results[0].result) == LookupResult(1, True)


def raw(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


@pytest.mark.parametrize("payload, match", [
    (b"\xc1garbage", "not a msgpack message"),
    (msgpack.packb([1, 2]), "must be a map"),
    (msgpack.packb({"v": 99, "op": "lookup"}), "protocol version 99, this side speaks"),
    (raw(op="launch_missiles", id=1), "unknown op"),
    (raw(op=5, id=1), "unknown op"),
    (raw(op="lookup", id=1), "missing field 'keys'"),
    (raw(op="lookup", id="1", keys=[]), "lookup.id: expected int, got str"),
    (raw(op="lookup", id=1, keys=[1, 2]), "expected bytes items, got int"),
    (raw(op="lookup", id=1, keys=b"abc"), "expected a list"),
    (raw(op="lookup", id=1, keys=[b""]), "1..64 bytes"),
    (raw(op="lookup", id=1, keys=[b"x" * 65]), "1..64 bytes"),
    (raw(op="lookup", id=1, keys=[b"k"] * (MAX_KEYS + 1)), "exceeds"),
    (raw(op="store", id=1, keys=[b"k"], gpu_block_ids=[1, 2]), "1 keys but 2"),
    (raw(op="store", id=1, keys=[b"k"], gpu_block_ids=[-1]), "negative"),
    (raw(op="lookup", id=True, keys=[]), "expected int, got bool"),
    (raw(op="tier_jobs", jobs=[{"job_id": 1}]), "missing field"),
    (raw(op="tier_jobs", jobs=[{"job_id": 1, "keys": [], "block_ids": [], "kind": "steal"}]),
     "not a valid JobKind"),
    (raw(op="step", id=1, **{"1": 2}), None),  # unknown extra fields are ignored
])
def test_malformed_input_is_a_protocol_error(payload, match):
    if match is None:
        assert decode(payload) == StepRequest(1)
        return
    with pytest.raises(ProtocolError, match=match):
        decode(payload)


def test_integer_map_keys_are_refused():
    payload = msgpack.packb({"v": 1, "op": "step", "id": 1, 5: 6})
    with pytest.raises(ProtocolError):
        decode(payload)


def test_allowed_ops_restrict_a_link():
    with pytest.raises(ProtocolError, match="unknown op 'tier_hello'"):
        decode(encode(TierHello("x", "memory", 1)), allowed=frozenset({"lookup"}))


def test_peek_id_finds_the_request_id_of_a_bad_message():
    assert peek_id(raw(op="lookup", id=42, keys=[1])) == 42
    assert peek_id(b"\xc1") is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_else(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(
    st.sampled_from(["v", "op", "id", "keys", "gpu_block_ids", "req_id", "jobs", "results"]),
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.binary(max_size=5),
              st.none(),
              st.lists(st.one_of(st.integers(-5, 5), st.binary(max_size=3)), max_size=4),
              st.sampled_from(list(_MESSAGES)))))
def test_random_maps_never_raise_anything_else(obj):
    try:
        decode(msgpack.packb(obj, use_bin_type=True))
    except ProtocolError:
        pass
