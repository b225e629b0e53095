"""What the disk tier (`workers.disk.backend`) does once, at start: check that the
blocks already in its directory have this node's geometry, choose between O_DIRECT
and buffered I/O, and read every slot's header to rebuild what the slots hold.
Apart from the backend because none of it runs again: the backend keeps the
bookkeeping of a running tier, this module the reading of a stopped one's files.
Runs on the tier process's main thread, before any I/O thread; may block.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.core.blockformat import HEADER_SIZE, CorruptBlock, unpack_header
from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.keys import OffloadKey
from workers.disk.layout import LAYOUT_VERSION, PAGE, SCAN_PROGRESS_SLOTS, ZERO_HEADER
from workers.disk.runs import Entry
from workers.disk.slabs import SlabFiles, fsync_dir, probe_o_direct

log = logging.getLogger("tierkv.disk")


def check_meta(directory: Path, block_bytes: int, slot_bytes: int, slots_per_slab: int,
               namespace: str) -> int:
    """The geometry of the blocks already here must be this node's; returns the
    slots per slab to use (the one on disk wins: it fixes where slots are)."""
    path = directory / "meta.json"
    want = {"layout_version": LAYOUT_VERSION, "block_bytes": block_bytes,
            "slot_bytes": slot_bytes, "slots_per_slab": slots_per_slab,
            "namespace": namespace}
    if path.exists():
        try:
            have = json.loads(path.read_text())
            same = all(have[k] == want[k] for k in
                       ("layout_version", "block_bytes", "slot_bytes", "namespace"))
            on_disk = int(have["slots_per_slab"])
        except (ValueError, KeyError, TypeError) as e:
            raise TierError(ErrorCode.FATAL, f"{path} is unreadable ({e}); "
                                             f"remove {directory} to start empty") from e
        if not same:
            raise TierError(ErrorCode.FATAL, (
                f"{directory} holds {have.get('block_bytes')}-byte blocks "
                f"(layout {have.get('layout_version')}), this node's are "
                f"{block_bytes} bytes: use another namespace or remove the directory"))
        if on_disk != slots_per_slab:
            log.info("keeping %d slots per slab as found in %s", on_disk, path)
        return on_disk
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(want, indent=1))
    os.replace(tmp, path)
    fsync_dir(directory)
    return slots_per_slab


def choose_direct(directory: Path, block_bytes: int, o_direct: str | bool) -> bool:
    """Whether to use O_DIRECT: "auto" where the filesystem and block size allow,
    True insists (an error saying why not), False never."""
    if o_direct is False:
        return False
    why = probe_o_direct(directory)
    if why is None and block_bytes % PAGE:
        why = f"blocks of {block_bytes} bytes are not a multiple of {PAGE}"
    if why is None:
        return True
    if o_direct is True:
        raise TierError(ErrorCode.FATAL, f"o_direct = true but O_DIRECT cannot be used in "
                                         f"{directory}: {why}")
    log.warning("disk tier %s: buffered I/O, no O_DIRECT (%s)", directory, why)
    return False


@dataclass
class SlotScan:
    """What the slots hold: the newest valid copy of each key, the free slots (in
    slot order), the slots of older copies (to be released), and counts."""

    found: dict[OffloadKey, Entry] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    scanned: int = 0
    invalid: int = 0  # slots whose header does not validate, or is another tier's


def scan_slots(slabs: SlabFiles, namespace_tag: bytes, block_bytes: int) -> SlotScan:
    """Read every slot's header: only 256 bytes per slot, no payload."""
    scan = SlotScan()
    on_disk = set(slabs.on_disk())
    top = max(on_disk) if on_disk else -1
    total = sum(slabs.backed(n) for n in on_disk)
    for n in range(top + 1):
        first = n * slabs.slots_per_slab
        # A slab below the last one that is missing or short: its slots are
        # free, and get their space when a store is written there.
        if n not in on_disk or n < top and slabs.backed(n) < slabs.slots_in(n):
            scan.free.extend(range(first + slabs.backed(n), first + slabs.slots_in(n)))
        if n not in on_disk:
            continue
        fd = slabs.get(n).fd
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead of payloads
        for i in range(slabs.backed(n)):
            _scan_slot(scan, fd, first + i, i * slabs.slot_bytes, namespace_tag, block_bytes)
            if scan.scanned % SCAN_PROGRESS_SLOTS == 0:
                log.info("disk tier scan: %d/%d slots, %d blocks", scan.scanned, total,
                         len(scan.found))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
    return scan


def _scan_slot(scan: SlotScan, fd: int, slot: int, offset: int, namespace_tag: bytes,
               block_bytes: int) -> None:
    read = _read_slot_header(scan, fd, slot, offset, namespace_tag, block_bytes)
    if read is None:
        scan.free.append(slot)
    else:
        key, new = read
        old = scan.found.get(key)
        if old is not None:  # two valid copies: the later write wins
            new, loser = (new, old) if new.seq > old.seq else (old, new)
            scan.stale.append(loser.slot)
        scan.found[key] = new
    scan.scanned += 1


def _read_slot_header(scan: SlotScan, fd: int, slot: int, offset: int, namespace_tag: bytes,
                      block_bytes: int) -> tuple[bytes, Entry] | None:
    raw = os.pread(fd, HEADER_SIZE, offset)
    if raw == ZERO_HEADER:
        return None
    try:
        header = unpack_header(raw)
    except CorruptBlock:
        scan.invalid += 1
        return None
    if header.namespace != namespace_tag or header.payload_len != block_bytes:
        scan.invalid += 1
        return None
    return header.key, Entry(slot, header.seq)
