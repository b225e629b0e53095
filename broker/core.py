"""The broker's logic, without sockets: BrokerCore takes decoded messages and the
clock, and sends through a callback. `broker.main` moves the socket traffic.

Single-threaded and event-driven: no locks around manager state. A step is a
client `step` request, or a tick when no client has stepped for `tick_ms`: worker
completions are applied, the `TieringManager` steps (tier completions applied,
promotions and cascades flushed), and queued tier jobs are dispatched.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.collector import Collector
from broker.events import EventRouter, tiers_hold
from broker.ops import GroupFailed, StepOps, check_fits
from broker.owners import Owner, OwnerTable
from broker.peer_links import PeerLinks, Send
from broker.peers import Peer, PeerTable
from broker.registrations import Registrations
from broker.remote_tier import RemoteTier
from broker.transfers import Transfer, TransferTracker
from broker.turns import Turns
from tierkv.core.errors import ErrorCode
from tierkv.core.keys import OffloadEvent, OffloadKey
from tierkv.core.loglimit import RateLimitedLog, foreign
from tierkv.core.tiering import TieringManager
from tierkv.node.config import Config
from tierkv.wire.protocol import (
    Bye,
    DetachKV,
    ErrorInfo,
    Heartbeat,
    Message,
    OpsRequest,
    OpsResult,
    ProtocolError,
    RegisterKVRequest,
    Reply,
    StatsRequest,
    TransferBatch,
    TransferJob,
    TransferOutcome,
    TransferResult,
    lost_job,
)

log = logging.getLogger("broker.core")

MAX_FINISHED_PER_CLIENT = 100_000


class RunState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(eq=False)
class _Wait:
    client: bytes
    request_id: int
    out: dict[str, Any]  # the answers so far
    jobs: set[int]
    deadline: float


def _gpu_ids_of(keys: list[OffloadKey], gpu_ids: list[int],
                accepted: list[OffloadKey]) -> list[int]:
    """The GPU block of each accepted key. All accepted (the usual store of new
    blocks: `accepted` is `keys` deduplicated and filtered, in order) is `gpu_ids`
    itself, without a dict of ~1000 keys."""
    if len(accepted) == len(keys):
        return gpu_ids
    gpu_of = dict(zip(keys, gpu_ids, strict=True))
    return [gpu_of[k] for k in accepted]


class BrokerCore(PeerLinks):
    """The client link (one `ops` request a step), transfers to the workers, steps,
    drain and stats; the peer links (hellos, registrations, liveness) are
    `PeerLinks`'s. One thread; never blocks."""

    def __init__(
        self,
        config: Config,
        manager: TieringManager,
        remote_tiers: dict[str, RemoteTier],
        send: Send,
        clock: Callable[[], float] = time.monotonic,
        publish: Callable[[list[OffloadEvent]], None] | None = None,
        tier_secret: str = "",
    ) -> None:
        self.config = config
        # What a tier process started outside the supervisor proves in its hello.
        self.tier_secret = tier_secret
        self.manager = manager
        self.remote_tiers = remote_tiers
        self._send = send
        self.clock = clock
        self.state = RunState.RUNNING
        self.peers = PeerTable(config.broker.heartbeat_s)
        self.transfers = TransferTracker()
        self.started_at = clock()
        # Job ids no other start of this broker issues: a client that lived through a
        # restart must never take the new broker's job for one it was given before.
        # Microseconds since the epoch stay ahead of any earlier start's ids as long
        # as jobs come slower than one a microsecond, which a Python broker cannot beat.
        self.first_job_id = time.time_ns() // 1000
        self._job_ids = itertools.count(self.first_job_id)
        self._workers: dict[int, Peer] = {}  # rank -> ready worker
        self.registrations = Registrations()
        broker = config.broker
        self.owners = OwnerTable(manager, owner_timeout_s=broker.owner_timeout_s,
                                 reservation_s=broker.reservation_s, pin_s=broker.pin_s,
                                 quota_blocks=int(broker.owner_share * config.cpu.num_blocks),
                                 on_end=self._owner_ended)
        self._last_liveness = clock()
        # Names the CPU region block ids refer to (see `OpsResult.region`).
        self.region_id = manager.region.generation if manager.region is not None else ""
        self._waiting: list[_Wait] = []  # `ops` requests waiting for jobs to finish
        self._outcomes: list[tuple[int, TransferOutcome]] = []  # applied at the next step
        self._finished: dict[bytes, list[TransferResult]] = {}
        # A key's owner is kept while a tier holds the key, not longer.
        self.events = EventRouter(publish, holds=tiers_hold(manager))
        self._warn = RateLimitedLog(log)  # what a peer can make the broker say, bounded
        # Peers that went silent and could not be fenced, and what their jobs hold.
        self._quarantine: dict[bytes, Peer] = {}
        self._held_jobs: dict[int, bytes] = {}  # transfer job -> the worker it waits on
        self._held_blocks: dict[bytes, list[tuple[str, list[OffloadKey]]]] = {}
        self._last_step = clock()
        self.counters: dict[str, int] = dict.fromkeys(
            ("requests", "protocol_errors", "request_errors", "steps", "ticks", "stores",
             "stores_refused", "loads", "transfers_failed", "late_outcomes", "peers_fenced",
             "peer_deaths", "dropped_results", "step_errors", "outcome_errors"), 0
        )
        self.turns = Turns()  # the loop's (`broker.main`): how long each keeps it busy
        self.collector = Collector()  # started by the loop: the process's collector
        self.step_ops = StepOps(manager, self.owners, self.events, clock, self.region_id,
                                self.store, self.load, self.counters)

    # -- client link ---------------------------------------------------------------

    def on_client(self, client: bytes, msg: Message) -> None:
        self.counters["requests"] += 1
        owner = self.owners.seen(client, self.clock())
        if isinstance(msg, Heartbeat):
            return  # the client library's ping while its engine is idle: no reply
        if isinstance(msg, Bye):
            self.owners.end(owner, "said bye")
        elif isinstance(msg, RegisterKVRequest):
            self._register_kv(client, msg)
        elif isinstance(msg, StatsRequest):
            stats = self.stats()
            if msg.verify:
                stats["invariants"] = self._check_invariants()
            self._reply(client, msg.id, True, result=stats)
        elif isinstance(msg, OpsRequest):
            self._ops(owner, msg)
        else:
            self.client_error(client, getattr(msg, "id", 0),
                              ProtocolError(f"op {msg.op!r} is not a client request"))

    def internal_error(self, client: bytes, request_id: int, error: Exception) -> None:
        """A request the broker failed to handle (a bug) still gets its reply."""
        self._reply(client, request_id, False, error=ErrorInfo(
            ErrorCode.FATAL.value, f"the broker could not handle this request "
            f"({type(error).__name__}); see its log"))

    def client_error(self, client: bytes, request_id: int | None, error: ProtocolError) -> None:
        self.counters["protocol_errors"] += 1
        self._reply(client, request_id or 0, False,
                    error=ErrorInfo(error.code.value, str(error)))

    def _ops(self, owner: Owner, msg: OpsRequest) -> None:
        client = owner.identity
        try:
            out = self.step_ops.run(owner, msg)
        except ProtocolError as e:
            self.client_error(client, msg.id, e)
            return
        self.counters["request_errors"] += len(out["errors"])
        if msg.step:
            self.step()
        if msg.step or msg.poll or msg.wait:
            out.update(finished=[], events=[], step=self.manager.step_count)
        wanted = set(msg.wait)
        if wanted:
            self._fail_unknown_jobs(client, wanted)
        if wanted and not self._finished_all(client, wanted) and msg.wait_s > 0:
            self._waiting.append(_Wait(client, msg.id, out, wanted,
                                       self.clock() + msg.wait_s))
            return
        self._answer(client, msg.id, out)

    def _answer(self, client: bytes, request_id: int, out: dict[str, Any]) -> None:
        if "finished" in out:
            out["finished"] = self._finished.pop(client, [])
            out["events"] = self.events.take(client)  # bounded: the rest at the next step
            out["events_dropped"] = self.events.take_dropped(client)
        self._reply(client, request_id, True, result=OpsResult(**out))

    def _reply(self, client: bytes, request_id: int, ok: bool, result: Any = None,
               error: ErrorInfo | None = None) -> None:
        """Every reply says how long the broker waits for a silent client: one made
        with the address alone (not the node's config) learns how often to ping."""
        self._send("client", client, Reply(request_id, ok, result, error,
                                           self.owners.owner_timeout_s))

    def _fail_unknown_jobs(self, client: bytes, wanted: set[int]) -> None:
        """Jobs this broker never issued (an earlier start's, to a client that lived
        through the restart) never finish here: they are answered failed at once, so
        the client neither waits them out nor reads bytes that never landed."""
        unknown = [j for j in wanted if j < self.first_job_id]
        if unknown:
            self._finished.setdefault(client, []).extend(
                lost_job(j, "not a job of this broker: the broker that issued it is gone")
                for j in unknown)

    def _finished_all(self, client: bytes, wanted: set[int]) -> bool:
        done = {r.job_id for r in self._finished.get(client, ())}
        return wanted <= done

    def _answer_waiting(self, expired: bool = False) -> None:
        """Requests that wait for jobs: answered once the jobs finished, or at their
        deadline with what finished by then."""
        now = self.clock()
        still = []
        for wait in self._waiting:
            if self._finished_all(wait.client, wait.jobs) or (expired and now > wait.deadline):
                self._answer(wait.client, wait.request_id, wait.out)
            else:
                still.append(wait)
        self._waiting = still

    # -- transfers (client -> workers) ---------------------------------------------------

    def _require_workers(self, what: str, client: bytes, tokens: list[str]) -> list[Peer]:
        if self.state is not RunState.RUNNING:
            raise GroupFailed(ErrorCode.UNAVAILABLE,
                              f"broker is {self.state.value}: no new {what}")
        workers = []
        for rank in range(self.config.cpu.world_size):
            peer = self._workers.get(rank)
            if peer is None:
                raise GroupFailed(ErrorCode.UNAVAILABLE, f"no worker is ready for rank {rank}")
            if not peer.extra.get("kv_attached"):
                raise GroupFailed(ErrorCode.UNAVAILABLE,
                                  f"rank {rank} has no KV cache registered")
            if not self.registrations.may_use(client, rank, tokens):
                raise GroupFailed(ErrorCode.NOT_OWNER, f"rank {rank}'s KV cache was registered "
                                  "by another client: a store or load needs the token its "
                                  "registration returned (Client.use_kv)")
            workers.append(peer)
        return workers

    def store(self, client: bytes, keys: list[OffloadKey], gpu_ids: list[int],
              req_id: str | None, tokens: list[str]) -> tuple[int | None, list[OffloadKey], bool]:
        """GPU -> CPU tier on every rank: (job id, keys accepted, refused)."""
        if len(gpu_ids) != len(keys) or min(gpu_ids, default=0) < 0:
            raise GroupFailed(ErrorCode.BAD_REQUEST, "a negative GPU block id")
        workers = self._require_workers("stores", client, tokens)
        check_fits(self.manager.primary, keys)
        out = self.manager.prepare_store(keys, req_id)
        if out is None:
            self.counters["stores_refused"] += 1
            return None, [], True
        if not out.keys_to_store:
            return None, [], False
        gpu = _gpu_ids_of(keys, gpu_ids, out.keys_to_store)
        transfer = self._start_transfer("store", client, out.keys_to_store, gpu, out.block_ids,
                                        workers)
        # After the job went out (the copy is what the client waits for): the keys'
        # events are routed at the step's end, not before.
        self.events.own(client, out.keys_to_store)
        self.counters["stores"] += 1
        return transfer.job_id, out.keys_to_store, False

    def load(self, client: bytes, keys: list[OffloadKey], gpu_ids: list[int],
             req_id: str | None, tokens: list[str]) -> tuple[int, dict[str, int]]:
        """CPU tier -> GPU on every rank: (job id, blocks promoted from each tier)."""
        if min(gpu_ids, default=0) < 0:
            raise GroupFailed(ErrorCode.BAD_REQUEST, "a negative GPU block id")
        workers = self._require_workers("loads", client, tokens)
        cpu_ids, sources = self.manager.prepare_load_from(keys, req_id)
        transfer = self._start_transfer("load", client, list(keys), gpu_ids, cpu_ids, workers)
        self.counters["loads"] += 1
        return transfer.job_id, sources

    def _start_transfer(
        self, kind: str, client: bytes, keys: list[bytes], gpu_ids: list[int],
        cpu_ids: list[int], workers: list[Peer],
    ) -> Transfer:
        deadline = self.clock() + self.config.broker.job_timeout_s
        transfer = Transfer(next(self._job_ids), kind, keys, gpu_ids, cpu_ids, client, deadline,
                            pending_ranks=set(range(len(workers))))
        self.transfers.start(transfer)
        job = TransferJob(transfer.job_id, kind, gpu_ids, cpu_ids, deadline)
        for rank, peer in enumerate(workers):
            if not self._send_peer(peer, TransferBatch([job])):
                self._outcomes.append((rank, TransferOutcome(
                    transfer.job_id, False, ErrorCode.UNAVAILABLE.value, "worker unreachable")))
        return transfer

    def _owner_ended(self, owner: Owner) -> None:
        """What else goes with a client: its requests, its answers, its registrations."""
        if owner.named_requests:  # a probe that only asked for stats has none
            self.manager.finish_all(owner.prefix)
            self.step_ops.forget(owner.prefix)
        self._finished.pop(owner.identity, None)
        self.events.forget(owner.identity)
        self._waiting = [w for w in self._waiting if w.client != owner.identity]
        for rank, token in self.registrations.drop_client(owner.identity):
            peer = self._workers.get(rank)
            if peer is not None:
                peer.extra["kv_attached"] = False
                # The worker would keep the exited engine's memory mapped otherwise.
                self._send_peer(peer, DetachKV(token))
            log.info("rank %d's KV registration ended with the client that made it", rank)

    # -- steps ---------------------------------------------------------------------

    def tick_due(self) -> float:
        """Seconds until the next tick (<= 0: now)."""
        return self._last_step + self.config.broker.tick_ms / 1000 - self.clock()

    def tick(self) -> None:
        self.counters["ticks"] += 1
        self.step()

    def step(self) -> None:
        self.counters["steps"] += 1
        self._last_step = self.clock()
        for phase in (self._apply_outcomes, self.manager.step, self._dispatch):
            try:
                phase()
            except Exception as e:  # a bug costs this phase of one step, not the node
                self.counters["step_errors"] += 1
                if self._warn.warning(("step", phase.__name__), "error in a step (%s): %s",
                                      phase.__name__, foreign(repr(e))):
                    log.debug("the traceback", exc_info=True)

    def _dispatch(self) -> None:
        for tier in self.remote_tiers.values():
            tier.dispatch()
        self.events.route(self.manager.take_events())

    def _apply_outcomes(self) -> None:
        outcomes, self._outcomes = self._outcomes, []
        done: list[Transfer] = []
        for rank, outcome in outcomes:
            try:
                transfer = self._apply_outcome(rank, outcome)
            except Exception as e:  # one job's outcome, not the others' and not the node
                self._outcome_error(outcome.job_id, e)
            else:
                if transfer is not None:
                    done.append(transfer)
        if self._waiting:
            # The clients waiting for these jobs hear first; the jobs' blocks are
            # made ready or released right after (1000 blocks: ~1.5 ms), before this
            # thread reads another message, so no request sees them in between.
            self._answer_waiting()
        for transfer in done:
            try:
                self._release_blocks(transfer)
            except Exception as e:  # one job's blocks, not the others' and not the node
                self._outcome_error(transfer.job_id, e)

    def _outcome_error(self, job_id: int, error: Exception) -> None:
        self.counters["outcome_errors"] += 1
        self._warn.warning(("outcome",), "could not apply job %d's outcome: %s",
                           job_id, foreign(repr(error)))

    def _apply_outcome(self, rank: int, outcome: TransferOutcome) -> Transfer | None:
        """Record one rank's outcome. Once every rank reported: the transfer, its
        result queued for its client (its blocks are `_release_blocks`'s)."""
        transfer = self.transfers.rank_done(rank, outcome)
        if transfer is None:
            if outcome.job_id not in self.transfers.jobs:
                self.counters["late_outcomes"] += 1
            return None
        if not transfer.success:
            self.counters["transfers_failed"] += 1
        if self.owners.get(transfer.client) is None:
            return transfer  # its client ended: nobody will collect the result
        finished = self._finished.setdefault(transfer.client, [])
        if len(finished) >= MAX_FINISHED_PER_CLIENT:
            finished.pop(0)
            self.counters["dropped_results"] += 1
        finished.append(transfer.result())
        return transfer

    def _release_blocks(self, transfer: Transfer) -> None:
        """A finished job's blocks: a store's become ready (or free, if it failed),
        a load's lose its readers."""
        holder = self._held_jobs.pop(transfer.job_id, None)
        if holder is not None and holder in self._quarantine:
            # A worker that may still write (or read) these rows: not yet.
            self._held_blocks.setdefault(holder, []).append((transfer.kind, transfer.keys))
        elif transfer.kind == "store":
            self.owners.complete_store(self.owners.get(transfer.client), transfer.keys,
                                       transfer.success)
        else:
            self.manager.complete_load(transfer.keys)

    # -- shutdown ------------------------------------------------------------------

    def begin_drain(self) -> None:
        if self.state is RunState.RUNNING:
            log.info("draining: no new stores or loads; waiting for %d transfers and %d "
                     "tier jobs", len(self.transfers), self.manager.in_flight)
            self.state = RunState.DRAINING

    def drained(self) -> bool:
        return (not self.transfers and not self._outcomes
                and all(t.drain() for t in self.remote_tiers.values())
                and self.manager.in_flight == 0)

    def say_goodbye(self) -> None:
        for peer in list(self.peers.peers.values()):
            self._send_peer(peer, Bye("broker stopping"))
        self.state = RunState.STOPPED

    # -- observation -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "instance": self.config.instance,
            "pid": os.getpid(),  # the supervisor's probe kills this pid when it hangs
            "state": self.state.value,
            "uptime_s": now - self.started_at,
            "broker": dict(self.counters),
            "owners": self.owners.stats(),
            "events": self.events.stats(),
            "transfers_in_flight": len(self.transfers),
            "turns": self.turns.stats(time.monotonic()),
            "collector": self.collector.stats(),
            "quarantined_peers": [p.label() for p in self._quarantine.values()],
            "peers": [
                {"kind": p.kind, "name": p.name, "pid": p.pid, "state": p.state.value,
                 "uptime_s": now - p.connected_at, "silent_s": now - p.last_seen,
                 **({"kv_attached": bool(p.extra.get("kv_attached")),
                     "pinned": p.extra.get("pinned")} if p.kind == "worker" else {})}
                for p in self.peers.peers.values()
            ],
            **self.manager.stats(),
        }

    def _check_invariants(self) -> str:
        try:
            self.manager.check_invariants()
            for transfer in self.transfers.jobs.values():
                held = [self.manager.primary.readers(k) for k in transfer.keys]
                if transfer.kind == "load":
                    assert all(h > 0 for h in held), f"load {transfer.job_id} lost its readers"
        except AssertionError as e:
            return f"violated: {e}"
        return "ok"
