"""Zero-copy block bodies for S3: a PUT streams [header, row] without joining them,
a GET reads the socket straight into the row where urllib3 allows it."""

from __future__ import annotations

import http.client
import io
from collections.abc import Callable
from typing import Any

from tierkv.core.errors import ErrorCode, TierError


class BlockBody(io.RawIOBase):
    """[header][payload] as one seekable stream, without joining them: `read` hands
    out memoryview slices of the two parts (http.client sends them as they are),
    and botocore rewinds it with `seek` to retry."""

    def __init__(self, header: bytes, payload: memoryview) -> None:
        super().__init__()
        self._parts = [memoryview(header), payload]
        self._size = len(header) + len(payload)
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        return self._pos

    def read(self, size: int | None = -1) -> memoryview:
        if self.closed:
            raise ValueError("read of a closed block body")
        if size is None or size < 0:
            size = self._size - self._pos
        offset = self._pos
        for part in self._parts:
            if offset < len(part):
                chunk = part[offset : offset + size]
                self._pos += len(chunk)
                return chunk
            offset -= len(part)
        return memoryview(b"")

    def readinto(self, b: Any) -> int:
        chunk = self.read(len(b))
        b[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        """Release our views of the row, so the region can be unmapped later."""
        for part in self._parts:
            part.release()
        super().close()


def flat_bytes(view: memoryview | bytes | bytearray) -> memoryview:
    mv = memoryview(view)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def body_reader(body: Any) -> tuple[Callable[[memoryview], int], Callable[[], None]]:
    """(readinto, release) for a GET body. Reads straight from the `http.client`
    response under urllib3 when nothing sits between it and the socket; otherwise
    botocore's `readinto` (which copies once inside urllib3)."""
    raw: Any = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if (raw is not None and isinstance(fp, http.client.HTTPResponse) and not fp.chunked
            and getattr(raw, "_fp_bytes_read", None) == 0
            and raw.headers.get("content-encoding", "identity") == "identity"):
        return fp.readinto, raw.release_conn
    return body.readinto, body.close


def fill_from(readinto: Callable[[memoryview], int], view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = readinto(view[pos:])
        if not n:
            raise StreamBroken(f"the response ended after {pos} of {len(view)} bytes")
        pos += n


class StreamBroken(TierError):
    """The connection failed while a body streamed: the object may be fine."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.RETRYABLE, message)

