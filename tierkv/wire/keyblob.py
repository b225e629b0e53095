"""Keys on the wire as one blob: no Python object per key on either side's hot path.

An engine step sends thousands of keys (256 requests x 64 keys). As a msgpack list
each key is an object to pack, to unpack and to check; as one contiguous blob of
fixed-width keys it is one `bytes`, checked with integer arithmetic, and split into
keys in C (`numpy` void items). Keys of different widths in one message are
allowed too (`lens`, one byte per key), on a slower path. Groups of keys (one per
request) are int32 counts into the blob, in order.

Every check here is total: a blob that does not divide, a width out of range, counts
that do not add up are a `ProtocolError`, never an exception deeper in the broker.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

import numpy as np

from tierkv.core.keys import MAX_KEY_LEN, OffloadKey
from tierkv.wire.codec import ProtocolError

COUNT = np.dtype("<i4")
_BIG_ENDIAN = sys.byteorder == "big"


def pack_keys(keys: Sequence[OffloadKey]) -> tuple[bytes, int, bytes]:
    """(blob, width, lens): width > 0 when every key has it, else lens."""
    if not keys:
        return b"", 0, b""
    width = len(keys[0])
    blob = b"".join(keys)
    if len(blob) == width * len(keys):
        return blob, width, b""
    return blob, 0, bytes(map(len, keys))


def check_blob(blob: bytes, width: int, lens: bytes, where: str) -> None:
    """A blob of keys of `width` bytes each, or of the lengths in `lens`."""
    if width:
        if not 0 < width <= MAX_KEY_LEN:
            raise ProtocolError(f"{where}: key width {width} is not 1..{MAX_KEY_LEN}")
        if lens or len(blob) % width:
            raise ProtocolError(f"{where}: {len(blob)} bytes of keys do not divide into "
                                f"keys of {width} bytes")
        return
    if not lens:
        if blob:
            raise ProtocolError(f"{where}: keys without a width or lengths")
        return
    sizes = np.frombuffer(lens, dtype=np.uint8)
    if sizes.min() < 1 or sizes.max() > MAX_KEY_LEN:
        raise ProtocolError(f"{where}: a key must be 1..{MAX_KEY_LEN} bytes")
    if int(sizes.sum()) != len(blob):
        raise ProtocolError(f"{where}: key lengths add up to {int(sizes.sum())}, "
                            f"the blob has {len(blob)} bytes")


def unpack_keys(blob: bytes, width: int, lens: bytes, where: str) -> list[OffloadKey]:
    """The keys of a blob, validated."""
    check_blob(blob, width, lens, where)
    if width:
        return np.frombuffer(blob, dtype=f"V{width}").tolist()
    if not lens:
        return []
    ends = np.cumsum(np.frombuffer(lens, dtype=np.uint8)).tolist()
    starts = [0, *ends[:-1]]
    return [blob[a:b] for a, b in zip(starts, ends, strict=True)]


def key_count(blob: bytes, width: int, lens: bytes) -> int:
    return len(blob) // width if width else len(lens)


def pack_counts(counts: Sequence[int]) -> bytes:
    out = array.array("i", counts)
    if _BIG_ENDIAN:
        out.byteswap()
    return out.tobytes()


def _little_endian(data: bytes, typecode: str) -> array.array:
    out = array.array(typecode)
    out.frombytes(data)
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def unpack_ints(data: bytes, typecode: str) -> list[int]:
    """Little-endian integers of an `array` typecode ("B" uint8, "i" int32, "q" int64)
    as a list: a reply's few per-group numbers cost a fraction of numpy's fixed cost."""
    return _little_endian(data, typecode).tolist()


def unpack_counts(data: bytes, where: str) -> array.array:
    """int32 counts (little endian), each >= 0. An `array` rather than numpy: a step
    has few groups, and numpy's fixed cost per call would dominate."""
    if len(data) % 4:
        raise ProtocolError(f"{where}: {len(data)} bytes are not int32 counts")
    counts = _little_endian(data, "i")
    if counts and min(counts) < 0:
        raise ProtocolError(f"{where}: a negative count")
    return counts
