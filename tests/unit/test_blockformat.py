"""The on-media block format: what validates and what never does."""

from __future__ import annotations

import os
import struct

import pytest

from tierkv.core.blockformat import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_KEY,
    MAX_NAMESPACE,
    CorruptBlock,
    checksum,
    pack_header,
    unpack_header,
    verify,
)
from tierkv.core.errors import ErrorCode

KEY = b"k" * 32
NS = b"llama3-8b/bf16/l32"
PAYLOAD = os.urandom(4096)
# The self-checked part of the header: the body plus its 8-byte checksum.
CHECKED = 8 + 2 + 2 + 2 + 8 + 8 + 8 + MAX_KEY + MAX_NAMESPACE + 8


def test_round_trip_keeps_every_field():
    raw = pack_header(KEY, NS, PAYLOAD, seq=12345)
    assert len(raw) == HEADER_SIZE and raw.startswith(MAGIC)
    header = unpack_header(raw)
    assert header.key == KEY and header.namespace == NS
    assert header.payload_len == len(PAYLOAD) and header.checksum == checksum(PAYLOAD)
    assert header.seq == 12345 and header.version == FORMAT_VERSION
    verify(header, KEY, NS, PAYLOAD)


def test_header_accepts_memoryviews_and_edge_lengths():
    header = unpack_header(memoryview(pack_header(b"x", b"", memoryview(b""))))
    assert header.key == b"x" and header.namespace == b"" and header.payload_len == 0
    long = unpack_header(pack_header(b"\xff" * MAX_KEY, b"n" * MAX_NAMESPACE, PAYLOAD))
    assert long.key == b"\xff" * MAX_KEY and long.namespace == b"n" * MAX_NAMESPACE


@pytest.mark.parametrize("position", range(CHECKED))
def test_any_flipped_header_byte_is_detected(position):
    raw = bytearray(pack_header(KEY, NS, PAYLOAD, seq=7))
    raw[position] ^= 0x01
    with pytest.raises(CorruptBlock) as e:
        unpack_header(bytes(raw))
    assert e.value.code is ErrorCode.CORRUPT


def test_zeroed_and_random_headers_never_validate():
    with pytest.raises(CorruptBlock, match="not a block header"):
        unpack_header(bytes(HEADER_SIZE))
    for _ in range(100):
        with pytest.raises(CorruptBlock):
            unpack_header(os.urandom(HEADER_SIZE))


def test_torn_header_is_detected():
    raw = pack_header(KEY, NS, PAYLOAD)
    # The first sector of a new header over the rest of an old one (another key).
    old = pack_header(b"o" * 32, NS, os.urandom(4096))
    with pytest.raises(CorruptBlock):
        unpack_header(raw[:64] + old[64:])
    with pytest.raises(CorruptBlock, match="truncated"):
        unpack_header(raw[: HEADER_SIZE - 1])


def test_other_version_is_refused_even_with_a_valid_checksum():
    import xxhash

    body = bytearray(pack_header(KEY, NS, PAYLOAD)[: CHECKED - 8])
    struct.pack_into("<H", body, 8, FORMAT_VERSION + 1)
    raw = bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body)))
    with pytest.raises(CorruptBlock, match="format version"):
        unpack_header(raw.ljust(HEADER_SIZE, b"\x00"))


def test_verify_catches_each_mismatch():
    header = unpack_header(pack_header(KEY, NS, PAYLOAD))
    with pytest.raises(CorruptBlock, match="holds key"):
        verify(header, b"other", NS, PAYLOAD)
    with pytest.raises(CorruptBlock, match="namespace"):
        verify(header, KEY, b"another-model", PAYLOAD)
    with pytest.raises(CorruptBlock, match="bytes, expected"):
        verify(header, KEY, NS, PAYLOAD[:-1])
    flipped = bytearray(PAYLOAD)
    flipped[len(flipped) // 2] ^= 0x80
    with pytest.raises(CorruptBlock, match="checksum"):
        verify(header, KEY, NS, flipped)
    torn = PAYLOAD[:2048] + bytes(2048)
    with pytest.raises(CorruptBlock, match="checksum"):
        verify(header, KEY, NS, torn)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="key"):
        pack_header(b"", NS, PAYLOAD)
    with pytest.raises(ValueError, match="key"):
        pack_header(b"k" * (MAX_KEY + 1), NS, PAYLOAD)
    with pytest.raises(ValueError, match="namespace"):
        pack_header(KEY, b"n" * (MAX_NAMESPACE + 1), PAYLOAD)
