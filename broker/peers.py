"""Who the broker talks to, whether they are alive, and how a hung one is fenced.

A peer (gpu worker or tier process) is NEW until its hello is accepted, READY
while it is heard from, and DEAD after 3 silent heartbeat intervals, a `bye`, or
a missed job deadline. Any message counts as a heartbeat (zguide's Paranoid
Pirate); the broker sends one only to a peer it has said nothing to for an
interval.

Fencing: every peer that writes CPU-tier rows or engine KV blocks runs on this
host (it maps the shared region). A peer that stops answering may only be hung
(SIGSTOP, a stuck syscall) and could wake up and write into rows the broker has
already reused, so before its jobs' blocks are released the broker kills it, but
only a process this node's supervisor started: the peer's hello must carry the
token the supervisor gave that very process (pid and start time checked,
`tierkv.node.children`). A peer's own claim is never evidence: anything else that
goes silent is not signalled, and the blocks of its jobs stay held until its
process is seen gone (quarantine), so a late write can never land in a reused row.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.core.shm import process_start_time
from tierkv.node.children import verified_child

log = logging.getLogger("broker.peers")


class PeerState(enum.Enum):
    NEW = "new"
    READY = "ready"
    DEAD = "dead"


@dataclass(eq=False)
class Peer:
    identity: bytes
    kind: str  # "worker" | "tier"
    name: str  # "rank0", or the tier name
    pid: int
    start_time: int
    connected_at: float
    last_seen: float
    last_sent: float = 0.0
    state: PeerState = PeerState.NEW
    restarts: int = 0
    token: str = ""  # from the hello: see `fence`
    extra: dict = field(default_factory=dict)

    def label(self) -> str:
        return f"{self.kind} {self.name} (pid {self.pid})"


def gone(peer: Peer) -> bool:
    """Is the peer's process known to have exited? Only from evidence: its pid is
    free, or now belongs to a process started at another time."""
    if peer.pid <= 0:
        return False  # no pid to look at: unknown
    started = process_start_time(peer.pid)
    if started is None:
        return True
    return bool(peer.start_time) and started != peer.start_time


def fence(peer: Peer, run_dir: Path) -> bool:
    """Make sure a silent peer cannot write any more. True if it is known to be gone
    (killed now, or already gone); False if it may still be alive: it was not
    started by this node (or its claim does not check out), so it is not signalled."""
    if gone(peer):
        return True
    if peer.pid == os.getpid() or not verified_child(run_dir, peer.token, peer.pid,
                                                     peer.start_time):
        return False
    try:
        os.kill(peer.pid, signal.SIGKILL)
        log.warning("fenced %s: killed it so it cannot write after its jobs failed",
                    peer.label())
        return True
    except ProcessLookupError:
        return True
    except PermissionError:
        log.error("cannot fence %s: not allowed to signal it", peer.label())
        return False


class PeerTable:
    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.peers: dict[bytes, Peer] = {}

    def get(self, identity: bytes) -> Peer | None:
        return self.peers.get(identity)

    def add(self, peer: Peer) -> None:
        self.peers[peer.identity] = peer

    def remove(self, identity: bytes) -> Peer | None:
        return self.peers.pop(identity, None)

    def seen(self, identity: bytes, now: float) -> Peer | None:
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = now
        return peer

    def silent(self, now: float) -> list[Peer]:
        """Peers not heard from for 3 intervals."""
        limit = 3 * self.heartbeat_s
        return [p for p in self.peers.values()
                if p.state is not PeerState.DEAD and now - p.last_seen > limit]

    def due_heartbeat(self, now: float) -> list[Peer]:
        return [p for p in self.peers.values()
                if p.state is PeerState.READY and now - p.last_sent >= self.heartbeat_s]

    def of_kind(self, kind: str) -> list[Peer]:
        return [p for p in self.peers.values() if p.kind == kind]
