"""The codec's compiled path (msgspec) against its Python path: the same maps on the
wire both ways, each reads what the other wrote, and bad input gets the same
ProtocolError from both, so a peer with either one speaks with a peer with the other."""

from __future__ import annotations

import msgpack
import pytest

from tests.unit.test_protocol import EXAMPLES
from tierkv.core.keys import OffloadEvent
from tierkv.tiers.base import JobResult
from tierkv.wire import codec
from tierkv.wire.codec import python_path
from tierkv.wire.keyblob import pack_counts, pack_keys
from tierkv.wire.protocol import (
    CLIENT_OPS,
    MAX_LIST,
    PROTOCOL_VERSION,
    KeyGroups,
    OpsRequest,
    OpsResult,
    ProtocolError,
    Reply,
    RequestContext,
    TierDoneBatch,
    TransferBatch,
    TransferJob,
    TransferResult,
    decode,
    encode,
)

pytest.importorskip("msgspec")


def test_this_process_runs_the_compiled_path_and_can_leave_it():
    assert codec.compiled()
    with python_path():
        assert not codec.compiled()
    assert codec.compiled()

KEYS = [i.to_bytes(16, "big") for i in range(64)]
BLOB, WIDTH, LENS = pack_keys(KEYS)
# What an engine step sends and gets back most: a lookup, its reply, a tier's results.
HOT = [
    OpsRequest(7, BLOB, WIDTH, LENS, lookup=KeyGroups(pack_counts([64]), ["r0"])),
    OpsRequest(8, BLOB, WIDTH, LENS, lookup=KeyGroups(pack_counts([32, 32]), ["a", "b"]),
               step=True, finish=["c"], contexts=[RequestContext("a", session="s", turn=2)]),
    TransferBatch([TransferJob(1, "store", [1, 2], [3, 4], deadline=5.0)]),
    TierDoneBatch([JobResult(3, True, (b"k",), bytes_moved=10)], credit=2),
]
# Free-form values: records at their top, or anywhere in a map (packed without
# their defaults either way).
FREE = [
    Reply(4, True, OpsResult(hits=pack_counts([1]), region="1.2"), None, 30.0),
    Reply(5, True, {"done": [TransferResult(1, "load", True)], "n": 2}),
]


def python_encode(msg: codec.Message) -> bytes:
    with python_path():
        return encode(msg)


def python_decode(data: bytes) -> codec.Message:
    with python_path():
        return decode(data)


@pytest.mark.parametrize("msg", EXAMPLES + HOT + FREE, ids=lambda m: type(m).__name__)
def test_both_paths_write_the_same_map_and_read_each_other(msg):
    compiled, python = encode(msg), python_encode(msg)
    assert msgpack.unpackb(compiled, raw=False) == msgpack.unpackb(python, raw=False)
    assert decode(python) == python_decode(compiled) == python_decode(python)
    assert decode(compiled) == python_decode(python)


@pytest.mark.parametrize("msg", HOT, ids=lambda m: type(m).__name__)
def test_the_hot_messages_are_read_by_the_compiled_path(msg):
    data = encode(msg)
    assert codec._decode_compiled(data, None) == msg
    assert codec._encode_compiled(msg) == data


def test_a_reply_of_one_record_is_packed_by_the_compiled_path():
    assert codec._encode_compiled(FREE[0]) == encode(FREE[0])


def test_a_reply_of_records_reads_back_into_them():
    result = OpsResult(hits=pack_counts([64]), state=b"\x00", region="12.34",
                       events=[OffloadEvent("stored", (b"a", b"b"), "cpu")])
    reply = decode(encode(Reply(3, True, result, None, 30.0)))
    assert codec.to_record(OpsResult, reply.result) == result
    assert reply.owner_timeout_s == 30.0


def raw(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def ops(**fields) -> bytes:
    return raw(**{"op": "ops", "id": 1, **fields})


BAD = {
    "an int for a bool": ops(step=1),
    "a bool for an int": ops(id=True),
    "a float for an int": ops(key_len=1.0),
    "a str for bytes": ops(keys="ab", key_len=1),
    "bytes for a str": ops(region=b"x"),
    "a map for a list": ops(finish={"a": 1}),
    "an integer map key in a record": ops(lookup={"counts": b"", 1: 2}),
    "an integer map key in free-form hints": ops(contexts=[{"req_id": "a", "hints": {1: 2}}]),
    "a missing field of a nested record": ops(contexts=[{"session": "s"}]),
    "a negative turn": ops(contexts=[{"req_id": "a", "turn": -5}]),
    "an unknown enum value": raw(op="tier_done", results=[
        {"job_id": 1, "success": False, "error_code": "no_such_code"}]),
    "an op of another link": raw(op="tier_hello", tier="x", type="memory", pid=1),
    "a version of a bool": msgpack.packb({"v": True, "op": "hb"}),
    "a truncated message": ops(keys=b"ab", key_len=1)[:-1],
    # Unknown fields are ignored, but what they hold is still checked as msgpack.
    "an unknown field named in bad UTF-8": b"\x84" + raw(op="ops", id=1)[1:] + b"\xa2\xeb\x01\x01",
    "an integer map key in an unknown field": ops(extra={1: 2}),
    "an integer map key in an unknown field of a record": ops(
        lookup={"counts": b"", "extra": {1: 2}}),
}


@pytest.mark.parametrize("payload", BAD.values(), ids=BAD.keys())
def test_bad_input_gets_the_same_protocol_error_from_both_paths(payload):
    with pytest.raises(ProtocolError) as compiled:
        decode(payload, CLIENT_OPS)
    with python_path(), pytest.raises(ProtocolError) as python:
        decode(payload, CLIENT_OPS)
    assert type(compiled.value) is type(python.value)
    assert str(compiled.value) == str(python.value)


def test_free_form_values_are_read_the_python_way():
    """Hints are free-form: what they may hold is what the Python path reads (an
    extension value as msgpack's ExtType), whichever path this side runs."""
    payload = ops(contexts=[{"req_id": "a", "hints": {"at": msgpack.ExtType(5, b"\x01")}}])
    assert decode(payload) == python_decode(payload)
    assert decode(payload).contexts[0].hints == {"at": msgpack.ExtType(5, b"\x01")}


def test_a_list_over_the_limit_in_a_long_message_is_refused_both_ways():
    payload = ops(finish=[""] * (MAX_LIST + 1))
    assert len(payload) > MAX_LIST
    for run in (decode, python_decode):
        with pytest.raises(ProtocolError, match="exceeds"):
            run(payload)
