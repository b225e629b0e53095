"""Who the broker talks to, whether they are alive, and how a hung one is fenced.

A peer (gpu worker or tier process) is NEW until its hello is accepted, READY
while it is heard from, and DEAD after 3 silent heartbeat intervals, a `bye`, or
a missed job deadline. Any message counts as a heartbeat (zguide's Paranoid
Pirate); the broker sends one only to a peer it has said nothing to for an
interval.

Fencing: every peer that writes CPU-tier rows or engine KV blocks runs on this
host (it maps the shared region). A peer that stops answering may only be hung
(SIGSTOP, a stuck syscall) and could wake up and write into rows the broker has
already reused, so before its jobs are failed and their blocks released the broker
kills it by pid (checked against its start time, so a reused pid is never hit).
The supervisor then restarts it.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
from dataclasses import dataclass, field

from tierkv.core.shm import process_start_time

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
    extra: dict = field(default_factory=dict)

    def label(self) -> str:
        return f"{self.kind} {self.name} (pid {self.pid})"


def fence(peer: Peer) -> bool:
    """Kill a peer that may still be alive. True if it is known to be gone."""
    if peer.pid <= 0:
        return True
    started = process_start_time(peer.pid)
    if started is None:
        return True  # already gone
    if peer.start_time and started and started != peer.start_time:
        return True  # the pid now belongs to someone else: ours is gone
    if peer.pid == os.getpid():
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
