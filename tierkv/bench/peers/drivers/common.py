"""What every driver shares: the JSON-lines loop, the blocks, the keys, the
workloads, cold caches and the corruptions.

Runs inside each driver process, so it imports only the standard library and
numpy: the same module is loaded by tierkv's own environment and by the peers'
(where `tierkv` is on the path only for this package). Everything a comparison
depends on is defined here once, so that every system stores the same bytes
under the same keys, replays the same requests and is corrupted the same way.

Protocol: the driver prints one line `{"ready": true, "system": ..., "versions":
{...}}`, then answers each request line `{"op": NAME, ...args}` with one line
`{"ok": true, "result": ...}` or `{"ok": false, "error": TEXT, "unsupported":
BOOL}`, until `{"op": "quit"}` or the end of its input. Anything a peer prints
goes to stderr: the protocol has stdout to itself.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

Handler = Callable[..., Any]
STAMP = 8  # bytes at each end of a block that carry its index
KEY_BYTES = 16


class Unsupported(Exception):
    """This system has no such feature (the row says so; it is not a failure)."""


class _Closable(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=_Closable)


class StoreDriver(Generic[S]):
    """A driver's one open store, from `disk_open` to `disk_close`."""

    def __init__(self) -> None:
        self.store: S | None = None

    def _need(self) -> S:
        if self.store is None:
            raise RuntimeError("no store is open (disk_open first)")
        return self.store

    def _open(self, store: S) -> S:
        self.disk_close()
        self.store = store
        return store

    def disk_close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


# -- the protocol -----------------------------------------------------------------------


def serve(system: str, versions: dict[str, str], handlers: dict[str, Handler]) -> int:
    """Answer requests from stdin until `quit`. A handler's exception becomes an
    error reply (with the traceback on stderr), never the end of the driver."""
    protocol = sys.stdout
    _send(protocol, {"ready": True, "system": system, "versions": versions,
                     "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.pop("op", None)
        if op == "quit":
            break
        handler = handlers.get(op or "")
        if handler is None:
            _send(protocol, {"ok": False, "error": f"unknown op {op!r}", "unsupported": True})
            continue
        try:
            with redirect_stdout(sys.stderr):  # peers print; the protocol is ours
                result = handler(**request)
            _send(protocol, {"ok": True, "result": result})
        except Unsupported as e:
            _send(protocol, {"ok": False, "error": str(e), "unsupported": True})
        except Exception as e:  # noqa: BLE001 - the reply carries it
            traceback.print_exc(file=sys.stderr)
            _send(protocol, {"ok": False, "error": f"{type(e).__name__}: {e}",
                             "unsupported": False})
    return 0


def _send(out: Any, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


# -- blocks and keys --------------------------------------------------------------------


def key_bytes(tag: str, i: int) -> bytes:
    """The key of block `i` of a pass: 16 bytes, the same for every system."""
    head = tag.encode()[:KEY_BYTES - 8].ljust(KEY_BYTES - 8, b"-")
    return head + i.to_bytes(8, "big")


def base_block(block_bytes: int, seed: int) -> np.ndarray:
    """The random bytes every block of a pass starts from."""
    return np.random.default_rng(seed).integers(0, 256, block_bytes, dtype=np.uint8)


def fill_block(dst: np.ndarray, base: np.ndarray, i: int) -> None:
    """Block `i`: the base bytes with `i` stamped at both ends, so that a block
    served under another block's key, or cut short, never compares equal."""
    dst[:] = base
    stamp = np.frombuffer(i.to_bytes(STAMP, "little"), dtype=np.uint8)
    dst[:STAMP] = stamp
    dst[-STAMP:] = stamp


def block_intact(got: np.ndarray, base: np.ndarray, i: int) -> bool:
    stamp = np.frombuffer(i.to_bytes(STAMP, "little"), dtype=np.uint8)
    return (bool(np.array_equal(got[:STAMP], stamp)) and bool(np.array_equal(got[-STAMP:], stamp))
            and bool(np.array_equal(got[STAMP:-STAMP], base[STAMP:-STAMP])))


def fill_blocks(rows: np.ndarray, base: np.ndarray, first: int = 0) -> None:
    """Every row of `rows` (count x block_bytes) as block first+r; touches every page."""
    rows[:] = base
    for r in range(len(rows)):
        fill_block(rows[r], base, first + r)


def count_bad(rows: np.ndarray, base: np.ndarray, first: int = 0) -> int:
    return sum(not block_intact(rows[r], base, first + r) for r in range(len(rows)))


# -- timing -------------------------------------------------------------------------------


def wait_until(done: Callable[[], bool], timeout: float, what: str,
               pause: float = 0.0005) -> None:
    """Poll `done` until it holds; a clear error after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {timeout:.0f} s")
        time.sleep(pause)


# -- files --------------------------------------------------------------------------------


def files_under(directory: str | Path) -> Iterator[Path]:
    for root, _dirs, names in os.walk(directory):
        for name in names:
            yield Path(root) / name


def sync_files(directory: str | Path, threads: int) -> int:
    """Make a file-per-block store's blocks durable as a store that synced its own
    writes would: `fdatasync` on every file under `directory`, issued by as many
    threads as the store writes with, then `fsync` on every directory (its renames
    and new names). Returns the files synced."""
    paths = list(files_under(directory))
    dirs = {str(p.parent) for p in paths} | {str(directory)}

    def flush(path: str | Path, flags: int = os.O_RDONLY) -> None:
        fd = os.open(path, flags)
        try:
            os.fdatasync(fd) if flags == os.O_RDONLY else os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(flush, paths))
        list(pool.map(lambda d: flush(d, os.O_RDONLY | os.O_DIRECTORY), sorted(dirs)))
    return len(paths)


# -- corruption ---------------------------------------------------------------------------

# A block's record on disk: (path, start, end) of the bytes that hold it (a whole
# file for a file-per-block store, a slot of a slab file for tierkv).
Record = tuple[str, int, int]
MODES = ("flip", "truncate", "swap")


def corrupt(mode: str, victim: Record, other: Record) -> str:
    """Damage `victim` the same way whatever the system: `flip` one byte in the
    middle of its record, `truncate` its file in the middle of its record, `swap`
    its bytes for `other`'s (a block stored under the wrong name). Says what it did."""
    path, start, end = victim
    if mode == "flip":
        at = start + (end - start) // 2
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        return f"flipped the byte at {at} of {Path(path).name}"
    if mode == "truncate":
        at = start + (end - start) // 2
        os.truncate(path, at)
        return f"truncated {Path(path).name} to {at} bytes"
    if mode == "swap":
        other_path, other_start, other_end = other
        with open(other_path, "rb") as f:
            f.seek(other_start)
            data = f.read(other_end - other_start)
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(data)
        return f"wrote the record of another block over {Path(path).name}"
    raise ValueError(f"unknown corruption {mode!r}; known: {', '.join(MODES)}")


def outcome(served: bool | None, intact: bool, error: str = "") -> str:
    """The row's word for what a load of a damaged block did."""
    if error:
        return f"raised {error}"
    if not served:
        return "detected"
    return "served intact bytes" if intact else "served wrong bytes"


# -- workloads ----------------------------------------------------------------------------


def manager_requests(n_requests: int, keys_per_request: int, seed: int,
                     families: int = 400) -> list[list[bytes]]:
    """Requests of `keys_per_request` keys: a shared prefix of a Zipf-popular
    family (a system prompt, a document, a conversation so far) of random length,
    then keys of the request's own. Every system replays exactly this list."""
    rng = random.Random(seed)
    weights = [1.0 / (f + 1) for f in range(families)]
    out = []
    for r in range(n_requests):
        family = rng.choices(range(families), weights)[0]
        shared = rng.randint(0, keys_per_request)
        keys = [(family << 32 | p).to_bytes(KEY_BYTES, "big") for p in range(shared)]
        keys += [((1 << 100) | (r << 16) | p).to_bytes(KEY_BYTES, "big")
                 for p in range(shared, keys_per_request)]
        out.append(keys)
    return out


def read_trace(path: str) -> list[list[bytes]]:
    """A Mooncake-format trace (one JSON request per line) as lists of block keys."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ids = json.loads(line)["hash_ids"]
                out.append([int(h).to_bytes(KEY_BYTES, "big") for h in ids])
    return out
