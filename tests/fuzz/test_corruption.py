"""Corruption of stored blocks, tried at random: bit flips in header and payload,
truncations, blocks swapped between keys, a block written under another namespace,
garbage. Every case must be detected at load (100%), never served, and counted;
on disk the bad slot is freed, on S3 the bad object deleted."""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config as BotoConfig

from tests.tiers.fixtures_s3 import TEST_ENV, fixture_s3_entry, fixture_s3_server  # noqa: F401
from tierkv.core.blockformat import HEADER_SIZE
from tierkv.core.errors import ErrorCode, TierError
from workers.disk import HEADER_AREA, DiskBackend, slot_bytes_for

BLOCK = 16 * 1024
TRIALS = 60
KINDS = ("header_flip", "payload_flip", "truncate", "swap", "other_namespace", "garbage")
TALLY: dict[str, Counter] = {}


def key(n: int) -> bytes:
    return b"blk-" + n.to_bytes(4, "big")


def payload(n: int) -> bytes:
    return random.Random(n).randbytes(BLOCK)


def check_detected(backend: Any, n: int, tally: Counter, kind: str) -> None:
    out = bytearray(BLOCK)
    try:
        backend.load(key(n), memoryview(out))
    except TierError as e:
        assert e.code in (ErrorCode.CORRUPT, ErrorCode.NOT_FOUND), e
        tally[f"{kind}:detected"] += 1
        tally[f"code:{e.code.value}"] += 1
        return
    # Loaded without complaint: only acceptable if the bytes are the key's own.
    assert bytes(out) == payload(n), f"{kind}: wrong bytes served for key {n}"
    tally[f"{kind}:harmless"] += 1


def run_trials(backend: Any, other: Any, corrupt: Callable[[str, int, int], None],
               name: str) -> Counter:
    rng = random.Random(20261129)
    tally: Counter = Counter()
    for n in range(8):
        backend.store(key(n), memoryview(payload(n)))
        other.store(key(n), memoryview(payload(1000 + n)))  # same keys, other namespace
    for _ in range(TRIALS):
        kind = rng.choice(KINDS)
        victim, donor = rng.sample(range(8), 2)
        corrupt(kind, victim, donor)
        check_detected(backend, victim, tally, kind)
        tally["tried"] += 1
        backend.store(key(victim), memoryview(payload(victim)))  # heal for the next trial
        if kind == "swap":
            backend.store(key(donor), memoryview(payload(donor)))
    TALLY[name] = tally
    print(f"\n{name} corruption trials: {dict(tally)}")
    return tally


# -- disk ---------------------------------------------------------------------------------


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[tuple[DiskBackend, DiskBackend]]:
    budget = 32 * slot_bytes_for(BLOCK)
    a = DiskBackend(str(tmp_path), budget, BLOCK, namespace="model-a", o_direct=False)
    b = DiskBackend(str(tmp_path), budget, BLOCK, namespace="model-b", o_direct=False)
    yield a, b
    a.close()
    b.close()


def slot_bytes(backend: DiskBackend, n: int) -> tuple[Path, int, int]:
    slabs = backend._slabs
    assert slabs is not None
    slot = backend._index[key(n)].slot
    slab_no, offset = slabs.locate(slot)
    return slabs.path(slab_no), offset, slabs.slot_bytes


def read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def write_at(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def test_disk_corruption_is_always_detected(disks):
    a, b = disks
    rng = random.Random(7)

    def corrupt(kind: str, victim: int, donor: int) -> None:
        path, offset, size = slot_bytes(a, victim)
        used = HEADER_AREA + BLOCK
        if kind == "header_flip":
            at = offset + rng.randrange(HEADER_SIZE)
            write_at(path, at, bytes([read_at(path, at, 1)[0] ^ (1 << rng.randrange(8))]))
        elif kind == "payload_flip":
            at = offset + HEADER_AREA + rng.randrange(BLOCK)
            write_at(path, at, bytes([read_at(path, at, 1)[0] ^ (1 << rng.randrange(8))]))
        elif kind == "truncate":
            cut = rng.randrange(HEADER_SIZE, used)
            write_at(path, offset + cut, bytes(used - cut))
        elif kind == "swap":
            other_path, other_offset, _ = slot_bytes(a, donor)
            mine, theirs = read_at(path, offset, used), read_at(other_path, other_offset, used)
            write_at(path, offset, theirs)
            write_at(other_path, other_offset, mine)
        elif kind == "other_namespace":
            b_path, b_offset, _ = slot_bytes(b, victim)
            write_at(path, offset, read_at(b_path, b_offset, used))
        else:
            write_at(path, offset, rng.randbytes(used))

    tally = run_trials(a, b, corrupt, "disk")
    detected = sum(v for k, v in tally.items() if k.endswith(":detected"))
    # A swap whose donor slot was read intact is impossible; every kind must be caught.
    assert detected == tally["tried"] == TRIALS
    assert a.stats()["corrupt_blocks"] == tally["code:corrupt"] > 0


# -- S3 -------------------------------------------------------------------------------------


def test_s3_corruption_is_always_detected(s3_entry):
    from workers.s3 import S3Backend

    options = {k: v for k, v in s3_entry.items() if k != "type"}
    a = S3Backend(block_bytes=BLOCK, namespace="model-a", **options)
    b = S3Backend(block_bytes=BLOCK, namespace="model-b", **options)
    raw = boto3.client("s3", endpoint_url=s3_entry["endpoint_url"], region_name="us-east-1",
                       aws_access_key_id=TEST_ENV["AWS_ACCESS_KEY_ID"],
                       aws_secret_access_key=TEST_ENV["AWS_SECRET_ACCESS_KEY"],
                       config=BotoConfig(s3={"addressing_style": "path"}))
    bucket = s3_entry["bucket"]
    rng = random.Random(11)

    def get(name: str) -> bytes:
        return raw.get_object(Bucket=bucket, Key=name)["Body"].read()

    def put(name: str, body: bytes) -> None:
        raw.put_object(Bucket=bucket, Key=name, Body=body)

    def corrupt(kind: str, victim: int, donor: int) -> None:
        name = a.object_name(key(victim))
        body = bytearray(get(name))
        if kind == "header_flip":
            body[rng.randrange(HEADER_SIZE)] ^= 1 << rng.randrange(8)
        elif kind == "payload_flip":
            body[HEADER_SIZE + rng.randrange(BLOCK)] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            body = body[: rng.randrange(len(body))]
        elif kind == "swap":
            donor_name = a.object_name(key(donor))
            theirs = get(donor_name)
            put(donor_name, bytes(body))
            body = bytearray(theirs)
        elif kind == "other_namespace":
            body = bytearray(get(b.object_name(key(victim))))
        else:
            body = bytearray(rng.randbytes(len(body)))
        put(name, bytes(body))

    try:
        tally = run_trials(a, b, corrupt, "s3")
        detected = sum(v for k, v in tally.items() if k.endswith(":detected"))
        assert detected == tally["tried"] == TRIALS
        assert a.stats()["errors_corrupt"] == tally["code:corrupt"] > 0
    finally:
        a.close()
        b.close()
