"""The broker's links to its peers, without sockets: the worker and tier processes'
hellos (who may join, by evidence), their messages, the engines' KV registrations
that workers attach, and liveness (heartbeats out, silent peers fenced, the blocks
of an unfenced peer's jobs held until its process is gone).

A part of `BrokerCore` (`broker.core`), kept apart because a peer's life is one
concern and a client's step another. Runs on the broker's one thread; never blocks.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

from broker.owners import OwnerTable
from broker.peers import Peer, PeerState, PeerTable, fence, gone
from broker.registrations import RegistrationRefused, Registrations
from broker.remote_tier import RemoteTier
from broker.transfers import TransferTracker
from tierkv.core.errors import ErrorCode
from tierkv.core.keys import OffloadKey
from tierkv.core.loglimit import RateLimitedLog, foreign
from tierkv.core.tiering import TieringManager
from tierkv.node.children import child_by_token
from tierkv.node.config import Config
from tierkv.wire.protocol import (
    AttachedKV,
    AttachKV,
    Bye,
    ErrorInfo,
    Heartbeat,
    Inventory,
    Message,
    Ready,
    Refused,
    RegisterKVRequest,
    TierDoneBatch,
    TierHello,
    TierStats,
    TransferDoneBatch,
    TransferOutcome,
    Welcome,
    WorkerHello,
)

log = logging.getLogger("broker.core")  # the core's: the broker's lines keep one name

Link = str  # "client" | "worker" | "tier"
Send = Callable[[Link, bytes, Message], bool]
# A gap this long between two liveness checks is the broker's own doing (one long
# message, a stalled machine): peers' silence over it is not held against them.
BUSY_GAP_S = 0.25


class PeerLinks:
    """The peer half of `BrokerCore`: it holds the state named below and gives the
    client half `_reply`, `step` and `_answer_waiting`."""

    config: Config
    tier_secret: str
    manager: TieringManager
    remote_tiers: dict[str, RemoteTier]
    clock: Callable[[], float]
    counters: dict[str, int]
    peers: PeerTable
    transfers: TransferTracker
    registrations: Registrations
    owners: OwnerTable
    _send: Send
    _warn: RateLimitedLog
    _workers: dict[int, Peer]  # rank -> ready worker
    _outcomes: list[tuple[int, TransferOutcome]]
    _waiting: list[Any]
    _last_liveness: float
    _quarantine: dict[bytes, Peer]
    _held_jobs: dict[int, bytes]
    _held_blocks: dict[bytes, list[tuple[str, list[OffloadKey]]]]
    _reply: Callable[..., None]
    step: Callable[[], None]
    _answer_waiting: Callable[..., None]

    # -- KV registration (engine -> worker) -----------------------------------------------

    def _register_kv(self, client: bytes, msg: RegisterKVRequest) -> None:
        def refuse(code: ErrorCode, why: str) -> None:
            self.counters["request_errors"] += 1
            self._reply(client, msg.id, False, error=ErrorInfo(code.value, why))

        if not 0 <= msg.rank < self.config.cpu.world_size:
            refuse(ErrorCode.BAD_REQUEST,
                   f"rank {msg.rank} out of range for world_size {self.config.cpu.world_size}")
            return
        try:
            same_engine = self.registrations.check(client, msg.rank, msg.registration, msg.token)
        except RegistrationRefused as e:
            refuse(ErrorCode.BAD_REQUEST, str(e))
            return
        peer = self._workers.get(msg.rank)
        if peer is None:
            self.registrations.wait_for_worker(client, msg.rank, msg.registration)
            refuse(ErrorCode.UNAVAILABLE, f"no worker is ready for rank {msg.rank}; "
                   "the registration is kept and sent when it comes")
            return
        self._attach(peer, client, msg.id, msg.rank, msg.registration, same_engine)

    def _attach(self, peer: Peer, client: bytes | None, request_id: int | None, rank: int,
                registration: dict[str, Any], same_engine: bool = False) -> None:
        deadline = self.clock() + self.config.broker.job_timeout_s
        reg_id, token = self.registrations.begin(client, request_id, rank, registration,
                                                 deadline, same_engine)
        self._send_peer(peer, AttachKV(reg_id, registration, token))

    def _on_attached(self, peer: Peer, msg: AttachedKV) -> None:
        if msg.ok:
            peer.extra["kv_attached"] = True
        else:  # the worker keeps the registration that works, if it had one
            log.error("%s could not attach a KV cache: %s", peer.label(), foreign(msg.error))
        pending, token = self.registrations.attached(msg.reg_id, msg.ok)
        if pending is None or pending.client is None or pending.request_id is None:
            return  # a re-attach after a worker restart: nobody is waiting
        if msg.ok:
            self._reply(pending.client, pending.request_id, True, result={
                "rank": pending.rank, "page_size": msg.page_size, "token": token})
        else:
            self._reply(pending.client, pending.request_id, False,
                        error=ErrorInfo(ErrorCode.BAD_REQUEST.value, msg.error))

    def _ready_peer(self, kind: str, identity: bytes, now: float) -> Any:
        """The peer a message on the `kind` link came from, if it said hello there;
        otherwise it is refused (and counted) and None is returned."""
        peer = self.peers.seen(identity, now)
        if peer is None or peer.state is not PeerState.READY or peer.kind != kind:
            self.counters["protocol_errors"] += 1
            self._send(kind, identity, Refused("say hello first"))
            return None
        return peer

    # -- worker link -----------------------------------------------------------------

    def on_worker(self, identity: bytes, msg: Message) -> None:
        now = self.clock()
        if isinstance(msg, WorkerHello):
            self._worker_hello(identity, msg, now)
            return
        peer = self._ready_peer("worker", identity, now)
        if peer is None:
            return
        if isinstance(msg, TransferDoneBatch):
            rank = peer.extra["rank"]
            self._outcomes.extend((rank, outcome) for outcome in msg.results)
            if self._waiting:
                # A client's step request is open until its jobs finish: it is the
                # step these completions are applied in, now rather than at the next
                # tick (up to `tick_ms` later: 5 ms added to every waited-for job).
                self.step()
        elif isinstance(msg, AttachedKV):
            self._on_attached(peer, msg)
        elif isinstance(msg, Bye):
            self._peer_gone(peer, f"said bye ({foreign(msg.reason, 60)})", fence_it=False)
        elif not isinstance(msg, Heartbeat):
            self.counters["protocol_errors"] += 1

    def _trusted(self, link: Link, identity: bytes, token: str,
                 tier: str = "") -> tuple[str, int, int] | None:
        """Who a hello comes from, by evidence: (slot, pid, start time) of a process
        the supervisor started and gave `token` (from its record, never the claim),
        or of a tier process that knows the tier secret (no pid: never fenced).
        None, after refusing it, for anyone else."""
        child = child_by_token(self.config.run_path, token)
        if child is not None:
            return child.name, child.pid, child.start_time
        if link == "tier" and token and self.tier_secret and \
                secrets.compare_digest(token, self.tier_secret):
            return f"{tier}@{identity.hex()}", -1, 0  # its own slot: one per connection
        self._refuse(link, identity, "this hello carries no token this node gave: only "
                     "processes its supervisor started may join (a tier process started "
                     "by hand proves the tier secret, broker.tier_secret_file)")
        return None

    def _worker_hello(self, identity: bytes, hello: WorkerHello, now: float) -> None:
        ws = self.config.cpu.world_size
        if hello.world_size != ws or not 0 <= hello.rank < ws:
            self._refuse("worker", identity, f"rank {hello.rank} of world size "
                         f"{hello.world_size} does not fit this broker (world size {ws})")
            return
        trusted = self._trusted("worker", identity, hello.token)
        if trusted is None:
            return
        _, pid, start_time = trusted
        current = self._workers.get(hello.rank)
        if current is not None and current.identity != identity:
            # A process the supervisor started for this rank: the same one on a new
            # session (it gave up on this broker while it hung), or its replacement.
            # Nothing to fence: a worker closes its transfer engine, which waits for
            # its copies, before it says hello again; a replaced one is gone.
            same = (current.pid, current.start_time) == (pid, start_time)
            self._peer_gone(current, "said hello on a new session" if same
                            else "replaced by a new worker", fence_it=False)
        peer = Peer(identity, "worker", f"rank{hello.rank}", pid, start_time,
                    connected_at=now, last_seen=now, state=PeerState.READY, token=hello.token,
                    extra={"rank": hello.rank, "device": hello.device, "pinned": hello.pinned,
                           "kv_attached": hello.registration is not None})
        self.peers.add(peer)
        self._workers[hello.rank] = peer
        self._welcome("worker", peer)
        log.info("%s ready (device %s)", peer.label(), foreign(hello.device, 20))
        if hello.registration is not None:
            # The worker kept the engine's KV cache across a broker restart.
            self.registrations.adopt(hello.rank, hello.registration, hello.registration_token)
            return
        again = self.registrations.for_new_worker(hello.rank)
        if again is not None:  # what the engine gave, for a new or restarted worker
            client, registration = again
            self._attach(peer, client, None, hello.rank, registration)

    # -- tier link -------------------------------------------------------------------

    def on_tier(self, identity: bytes, msg: Message) -> None:
        now = self.clock()
        if isinstance(msg, TierHello):
            self._tier_hello(identity, msg, now)
            return
        peer = self._ready_peer("tier", identity, now)
        if peer is None:
            return
        tier = self.remote_tiers[peer.name]
        if isinstance(msg, TierDoneBatch):
            tier.on_done(identity, msg)
        elif isinstance(msg, Ready):
            tier.on_credit(identity, msg.credit)
        elif isinstance(msg, Inventory):
            tier.on_inventory(identity, msg.keys, msg.last)
        elif isinstance(msg, TierStats):
            tier.on_stats(identity, msg.stats)
        elif isinstance(msg, Bye):
            self._peer_gone(peer, f"said bye ({foreign(msg.reason, 60)})", fence_it=False)
        elif not isinstance(msg, Heartbeat):
            self.counters["protocol_errors"] += 1

    def _tier_hello(self, identity: bytes, hello: TierHello, now: float) -> None:
        tier = self.remote_tiers.get(hello.tier)
        if tier is None:
            self._refuse("tier", identity, f"tier {hello.tier!r} is not configured "
                         f"(tiers: {', '.join(self.remote_tiers) or 'none'})")
            return
        if hello.namespace and hello.namespace != self.config.namespace:
            self._refuse("tier", identity, f"namespace {hello.namespace!r} differs from "
                         f"the broker's {self.config.namespace!r}")
            return
        trusted = self._trusted("tier", identity, hello.token, hello.tier)
        if trusted is None:
            return
        slot, pid, start_time = trusted
        if pid < 0:
            # Not the supervisor's: never signalled (`broker.peers.fence`). Its claimed
            # pid only keeps the rows of its jobs held until that process is gone.
            pid, start_time = hello.pid, hello.start_time
        for old in list(self.peers.peers.values()):
            # The same connection again, or a new process in a dead one's slot (the
            # supervisor restarted it before the broker noticed): the old one's
            # membership, and the blocks it reported, end now.
            if old.identity == identity or (old.kind == "tier" and old.extra.get("slot") == slot):
                self._peer_gone(old, "said hello again" if old.identity == identity
                                else "replaced by a new process", fence_it=False)
        peer = Peer(identity, "tier", hello.tier, pid, start_time,
                    connected_at=now, last_seen=now, state=PeerState.READY, token=hello.token,
                    extra={"slot": slot})
        self.peers.add(peer)
        tier.on_hello(identity, hello)
        self._welcome("tier", peer)
        log.info("%s connected (%s, %d blocks to report)", peer.label(), foreign(hello.type, 20),
                 hello.inventory_total)

    # -- liveness ------------------------------------------------------------------

    def check_liveness(self) -> None:
        """Heartbeats out, silent peers dead, overdue jobs fenced. Call often."""
        now = self.clock()
        gap, self._last_liveness = now - self._last_liveness, now
        if gap > min(BUSY_GAP_S, self.config.broker.heartbeat_s / 2):
            # The broker did not listen for `gap`: nobody was silent during it.
            for peer in self.peers.peers.values():
                peer.last_seen = min(now, peer.last_seen + gap)
            self.owners.credit(gap, now)
            self.transfers.credit(gap)
            for tier in self.remote_tiers.values():
                tier.credit(gap)
        self.owners.expire(now)
        for peer in self.peers.silent(now):
            self._peer_gone(peer, f"silent for {now - peer.last_seen:.1f}s", fence_it=True)
        for transfer in self.transfers.overdue(now, 3 * self.config.broker.heartbeat_s):
            for rank in list(transfer.pending_ranks):
                worker = self._workers.get(rank)
                if worker is not None:
                    self._peer_gone(worker, f"job {transfer.job_id} passed its deadline "
                                    f"(broker.job_timeout_s={self.config.broker.job_timeout_s})",
                                    fence_it=True)
                else:
                    self._outcomes.append((rank, TransferOutcome(
                        transfer.job_id, False, ErrorCode.TIMEOUT.value, "deadline passed")))
                    transfer.deadline = 0  # reported once
        for tier in self.remote_tiers.values():
            for identity in tier.overdue(now):
                holder = self.peers.get(identity)
                if holder is not None:
                    self._peer_gone(holder, f"held a job {tier.fence_grace_s:.1f}s past its "
                                    f"deadline (broker.job_timeout_s="
                                    f"{self.config.broker.job_timeout_s})", fence_it=True)
        for pending in self.registrations.overdue(now):
            if pending.client is not None and pending.request_id is not None:
                why = f"worker of rank {pending.rank} did not attach in time"
                self._reply(pending.client, pending.request_id, False,
                            error=ErrorInfo(ErrorCode.TIMEOUT.value, why))
        for peer in self.peers.due_heartbeat(now):
            self._send_peer(peer, Heartbeat())
        if self._waiting:
            self._answer_waiting(expired=True)
        if self._quarantine:
            self._release_quarantined()

    def _peer_gone(self, peer: Peer, reason: str, fence_it: bool) -> None:
        """Forget a peer and fail its jobs. One that went silent (`fence_it`) is
        fenced first; if it cannot be (not started by this node, or its claim does
        not check out), the blocks of its jobs stay held until its process is gone."""
        hold = False
        if fence_it:
            if fence(peer, self.config.run_path):
                self.counters["peers_fenced"] += 1
            else:
                hold = True
                self._quarantine[peer.identity] = peer
                log.warning("%s stopped answering and was not started by this node's "
                            "supervisor, so it is not killed: the blocks of its jobs stay "
                            "reserved until pid %d exits", peer.label(), peer.pid)
        log.warning("%s is gone: %s", peer.label(), reason)
        self.counters["peer_deaths"] += 1
        peer.state = PeerState.DEAD
        self.peers.remove(peer.identity)
        if peer.kind == "worker":
            rank = peer.extra["rank"]
            if self._workers.get(rank) is peer:
                del self._workers[rank]
            for transfer in list(self.transfers.jobs.values()):
                if rank in transfer.pending_ranks:
                    if hold:
                        self._held_jobs[transfer.job_id] = peer.identity
                    self._outcomes.append((rank, TransferOutcome(
                        transfer.job_id, False, ErrorCode.UNAVAILABLE.value,
                        f"worker of rank {rank} died: {reason}")))
        else:
            self.remote_tiers[peer.name].peer_died(peer.identity, reason, hold=hold)

    def _release_quarantined(self) -> None:
        """The blocks of a peer that could not be fenced are released once its
        process is seen gone."""
        for identity, peer in list(self._quarantine.items()):
            if not gone(peer):
                continue
            del self._quarantine[identity]
            if peer.kind == "tier":
                self.remote_tiers[peer.name].release_held(identity)
            for kind, keys in self._held_blocks.pop(identity, ()):
                if kind == "store":
                    self.manager.complete_store(keys, False)
                else:
                    self.manager.complete_load(keys)
            log.info("%s has exited: the blocks of its jobs are released", peer.label())

    # -- helpers -------------------------------------------------------------------

    def _send_peer(self, peer: Peer, msg: Message) -> bool:
        peer.last_sent = self.clock()
        return self._send(peer.kind, peer.identity, msg)

    def _welcome(self, link: Link, peer: Peer) -> None:
        cpu = self.config.cpu
        self._send_peer(peer, Welcome(self.config.instance, cpu.num_blocks, cpu.page_size,
                                      cpu.world_size, self.config.broker.heartbeat_s,
                                      self.config.namespace))

    def _refuse(self, link: Link, identity: bytes, reason: str) -> None:
        self._warn.warning((link, identity), "refused a %s: %s", link, foreign(reason))
        self.counters["request_errors"] += 1
        self._send(link, identity, Refused(reason))
