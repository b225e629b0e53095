"""The on-media format of a block in a secondary tier (disk slot, S3 object).

    [ header, 256 bytes ][ payload, payload_len bytes ]

The header carries the format version, the key, the namespace, the payload length,
an xxh3-64 checksum of the payload, a write sequence number, and an xxh3-64 of
the header itself. A load checks all of it before a block becomes readable, so a
torn write, a bit flip, a truncation, a block swapped between keys or written
under another namespace is detected and never served.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from tierkv.core.errors import ErrorCode, TierError

MAGIC = b"TKVBLK\x00\x01"
FORMAT_VERSION = 1
HEADER_SIZE = 256
MAX_KEY = 64
MAX_NAMESPACE = 128
# magic, version, key_len, namespace_len, payload_len, payload xxh3, seq, key, namespace
_BODY = struct.Struct(f"<8sHHHQQQ{MAX_KEY}s{MAX_NAMESPACE}s")
_HEADER_SUM = struct.Struct("<Q")
assert _BODY.size + _HEADER_SUM.size <= HEADER_SIZE


class CorruptBlock(TierError):
    """A block that failed verification; the message says which check."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CORRUPT, message)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key: bytes
    namespace: bytes
    payload_len: int
    checksum: int
    seq: int = 0
    version: int = FORMAT_VERSION


def checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack_header(
    key: bytes, namespace: bytes, payload: bytes | memoryview, seq: int = 0
) -> bytes:
    if not 0 < len(key) <= MAX_KEY:
        raise ValueError(f"key must be 1..{MAX_KEY} bytes, got {len(key)}")
    if len(namespace) > MAX_NAMESPACE:
        raise ValueError(f"namespace must be at most {MAX_NAMESPACE} bytes, got {len(namespace)}")
    body = _BODY.pack(MAGIC, FORMAT_VERSION, len(key), len(namespace), len(payload),
                      checksum(payload), seq, key, namespace)
    header = body + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(body))
    return header + bytes(HEADER_SIZE - len(header))


def unpack_header(buf: bytes | memoryview) -> BlockHeader:
    """Parse and self-check a header (not the payload). Raises CorruptBlock."""
    if len(buf) < HEADER_SIZE:
        raise CorruptBlock(f"header truncated: {len(buf)} of {HEADER_SIZE} bytes")
    body = bytes(buf[: _BODY.size])
    (stored_sum,) = _HEADER_SUM.unpack_from(buf, _BODY.size)
    if xxhash.xxh3_64_intdigest(body) != stored_sum:
        magic_ok = body[:8] == MAGIC
        raise CorruptBlock("not a block header" if not magic_ok else "header checksum mismatch")
    magic, version, key_len, ns_len, payload_len, payload_sum, seq, key, ns = _BODY.unpack(body)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"format version {version}, this tierkv reads {FORMAT_VERSION}")
    if not 0 < key_len <= MAX_KEY or ns_len > MAX_NAMESPACE:
        raise CorruptBlock("key or namespace length out of range")
    return BlockHeader(key[:key_len], ns[:ns_len], payload_len, payload_sum, seq, version)


def verify(
    header: BlockHeader, key: bytes, namespace: bytes, payload: bytes | memoryview
) -> None:
    """Check that `payload` is the whole, intact block of `key` in `namespace`."""
    if header.key != key:
        raise CorruptBlock(f"holds key {header.key.hex()}, expected {key.hex()}")
    if header.namespace != namespace:
        raise CorruptBlock(
            f"written under namespace {header.namespace!r}, expected {namespace!r}"
        )
    if header.payload_len != len(payload):
        raise CorruptBlock(f"payload is {header.payload_len} bytes, expected {len(payload)}")
    if checksum(payload) != header.checksum:
        raise CorruptBlock("payload checksum mismatch")
