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
from tierkv.wire.keyblob import pack_counts, unpack_keys
from tierkv.wire.protocol import (
    PROTOCOL_VERSION,
    AttachedKV,
    AttachKV,
    Bye,
    DetachKV,
    ErrorInfo,
    EventBatch,
    Heartbeat,
    Inventory,
    KeyGroups,
    OpError,
    OpsRequest,
    OpsResult,
    ProtocolError,
    Ready,
    Refused,
    RegisterKVRequest,
    Reply,
    RequestContext,
    StatsRequest,
    TierDoneBatch,
    TierHello,
    TierJobBatch,
    TierStats,
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
    OpsRequest(3, b"".join(K[:1] * 3), 8, b"", lookup=KeyGroups(pack_counts([2]), ["r1"]),
               pin=KeyGroups(pack_counts([1])), finish=["r0"], step=True,
               contexts=[RequestContext("r1", ["disk"], "s", 2, True, 30.0, {"a": [1]})]),
    OpsRequest(4, b"".join(K), 0, bytes([8, 64]), store=KeyGroups(pack_counts([2])),
               store_gpu=b"\x01\x00\x00\x00" * 2, wait=[5], wait_s=1.0),
    StatsRequest(10),
    RegisterKVRequest(12, 0, {"device": "cpu", "tensors": [{"shm": "/x", "shape": [1, 2]}]}),
    WorkerHello(0, 2, 123, 456, "cpu"),
    TransferBatch([TransferJob(1, "store", [1, 2], [3, 4], 12.5)]),
    TransferDoneBatch([TransferOutcome(1, False, "timeout", "late", 10, 0.5)]),
    AttachKV(1, {"a": 1}),
    DetachKV("t0"),
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
    result = OpsResult(hits=b"\x01\x00\x00\x00", state=b"\x01", tiers=["disk"],
                       errors=[OpError("pin", 0, "bad_request", "not ready")],
                       finished=[TransferResult(1, "load", True)],
                       events=[OffloadEvent("stored", (b"a",), "cpu")], step=3)
    reply = decode(encode(Reply(1, True, result=result)))
    assert to_record(OpsResult, reply.result) == result


def raw(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def lookup(**fields) -> bytes:
    return raw(op="ops", id=1, **fields)


@pytest.mark.parametrize("payload, match", [
    (b"\xc1garbage", "not a msgpack message"),
    (msgpack.packb([1, 2]), "must be a map"),
    (msgpack.packb({"v": 99, "op": "ops"}), "protocol version 99, this side speaks"),
    (msgpack.packb({"v": 1, "op": "lookup", "id": 1, "keys": []}), "protocol version 1"),
    (raw(op="launch_missiles", id=1), "unknown op"),
    (raw(op=5, id=1), "unknown op"),
    (raw(op="ops"), "missing field 'id'"),
    (raw(op="ops", id="1"), "ops.id: expected int, got str"),
    (lookup(keys=b"abc", key_len=2), "do not divide"),
    (lookup(keys=b"ab", key_len=65), "1..64"),
    (lookup(keys=b"ab", key_len=0), "without a width"),
    (lookup(keys=b"ab", key_lens=b"\x01\x02"), "add up to 3"),
    (lookup(keys=b"a", key_lens=b"\x00"), "1..64 bytes"),
    (lookup(keys=b"ab", key_len=1, lookup={"counts": b"\x01\x00"}), "int32"),
    (lookup(keys=b"ab", key_len=1, lookup={"counts": pack_counts([3])}), "take 3 keys"),
    (lookup(keys=b"ab", key_len=1, lookup={"counts": pack_counts([-1, 3])}), "negative"),
    (lookup(keys=b"ab", key_len=1, lookup={"counts": pack_counts([1, 1]), "req_ids": ["x"]}),
     "1 req_ids for 2 groups"),
    (lookup(keys=b"ab", key_len=1, store={"counts": pack_counts([2])}, store_gpu=b"\x00"),
     "ops.store_gpu"),
    (lookup(keys=b"ab", key_len=1, lookup={"counts": [2]}), "expected bytes"),
    (lookup(wait_s=-1.0), "wait_s"),
    (raw(op="tier_jobs", jobs=[{"job_id": 1}]), "missing field"),
    (raw(op="tier_jobs", jobs=[{"job_id": 1, "keys": [], "block_ids": [], "kind": "steal"}]),
     "not a valid JobKind"),
    # A nested record's field is named by its whole path.
    (raw(op="tier_jobs", jobs=[{"job_id": "1", "keys": [], "block_ids": [], "kind": "store"}]),
     r"^tier_jobs\.jobs\[0\]\.job_id: expected int, got str$"),
    (raw(op="tier_jobs", jobs=[{"job_id": 1}]), r"^tier_jobs\.jobs\[0\]: missing field"),
    (raw(op="ops", id=1, step=True, **{"1": 2}), None),  # unknown extra fields are ignored
])
def test_malformed_input_is_a_protocol_error(payload, match):
    if match is None:
        assert decode(payload) == OpsRequest(1, step=True)
        return
    with pytest.raises(ProtocolError, match=match):
        decode(payload)


def test_a_reply_s_integers_read_back_little_endian_whatever_their_sign():
    import numpy as np

    from tierkv.wire.keyblob import unpack_ints

    int32 = [-1, 0, 7, 2**31 - 1, -(2**31)]
    int64 = [-1, 2**40, 2**63 - 1]
    assert unpack_ints(np.asarray(int32, "<i4").tobytes(), "i") == int32
    assert unpack_ints(np.asarray(int64, "<i8").tobytes(), "q") == int64
    assert unpack_ints(b"", "i") == []
    with pytest.raises(ValueError):
        unpack_ints(b"\x01\x02\x03", "i")  # not whole int32s


def test_keys_of_one_width_and_of_several_come_back_whole():
    fixed = [b"\x00" * 15 + b"\x01", b"\x01" + b"\x00" * 15]  # zeros at both ends survive
    assert unpack_keys(b"".join(fixed), 16, b"", "k") == fixed
    mixed = [b"a", b"bb" * 32, b"\x00c"]
    assert unpack_keys(b"".join(mixed), 0, bytes(map(len, mixed)), "k") == mixed


def test_integer_map_keys_are_refused():
    payload = msgpack.packb({"v": PROTOCOL_VERSION, "op": "ops", "id": 1, 5: 6})
    with pytest.raises(ProtocolError):
        decode(payload)


def test_allowed_ops_restrict_a_link():
    with pytest.raises(ProtocolError, match="unknown op 'tier_hello'"):
        decode(encode(TierHello("x", "memory", 1)), allowed=frozenset({"ops"}))


def test_peek_id_finds_the_request_id_of_a_bad_message():
    assert peek_id(raw(op="ops", id=42, keys=[1])) == 42
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
    st.sampled_from(["v", "op", "id", "keys", "key_len", "lookup", "store_gpu", "jobs",
                     "results"]),
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.binary(max_size=5),
              st.none(),
              st.lists(st.one_of(st.integers(-5, 5), st.binary(max_size=3)), max_size=4),
              st.sampled_from(list(_MESSAGES)))))
def test_random_maps_never_raise_anything_else(obj):
    try:
        decode(msgpack.packb(obj, use_bin_type=True))
    except ProtocolError:
        pass
