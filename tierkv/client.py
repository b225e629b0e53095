"""The scheduler-side API: talk to a tierkv broker over ZeroMQ.

    from tierkv.client import Client
    c = Client.from_config("tierkv.toml")      # or Client("ipc:///run/.../client.sock")
    hit = c.lookup(keys, req_id="r1")          # Lookup(hits, pending)
    s = c.store(keys, gpu_block_ids, req_id="r1")
    done = c.step()                            # Step(finished, events)

An engine sends all the operations of one step in one round trip: `c.batch()`
collects them (`b.lookup(...)`, `b.pin(...)`, `b.reserve(...)`, `b.step()`, ...) and
`b.send()` sends one `ops` message with every key in one blob (protocol v2, see
`tierkv.wire.protocol`) and returns one result per call, in call order. The broker
runs the sections in a fixed order (commit, release, lookup, pin, load, reserve,
store, touch, finish, then step), whatever the order of the calls: reads are
protected before anything allocates, and a request finishes after its own loads.

Every call waits at most `timeout` seconds and then raises `BrokerUnavailable`
(the socket is rebuilt, so a broker that restarts is found again). A refusal by
the broker is a `RemoteError` with a `code` from `tierkv.core.errors.ErrorCode`.
A `Client` is not thread-safe: one per thread.

Ordering contract for stores: call `store` only after the engine step that
wrote those GPU blocks has synchronized its output; the worker reads them as soon
as the job arrives. A `load` has landed in the GPU blocks when its job is in a
`Step.finished` with `success=True`.

Engines that copy the bytes themselves (`reserve`/`commit`, `pin`/`release`) write
and read the rows of the node's shared CPU region whose ids these calls return:
write a reserved row, then `commit` it; read a pinned row, then `release` it.
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import zmq

# The calls' results and errors, and the batch, each in a module of its own; named
# here too, where engines import them from.
from tierkv.batch import Batch
from tierkv.client_results import (
    BrokerUnavailable,
    JobResult,
    Load,
    LoadResult,
    Lookup,
    LookupResult,
    RemoteError,
    Reserve,
    Step,
    StepResult,
    Store,
    StoreResult,
)
from tierkv.core.keys import OffloadEvent, OffloadKey
from tierkv.node.config import Config, load_config
from tierkv.node.realtime import WaitBoost, check_priority, lift_context
from tierkv.wire.protocol import (
    MAX_KEY_TOKENS,
    Bye,
    Heartbeat,
    Message,
    ProtocolError,
    RegisterKVRequest,
    Reply,
    RequestContext,
    StatsRequest,
    decode,
    encode,
    lost_job,
)
from tierkv.wire.sockets import CurveClientKeys, connect, curve_client, ipc_path, make_socket

T = TypeVar("T")

__all__ = ["Batch", "BrokerUnavailable", "Client", "JobResult", "Load", "LoadResult", "Lookup",
           "LookupResult", "ProtocolError", "RemoteError", "RequestContext", "Reserve", "Step",
           "StepResult", "Store", "StoreResult"]


PING_S = 5.0  # an idle client says it is alive this often (broker.owner_timeout_s: 30)
PING_CHECK_S = 0.5  # the most the ping thread sleeps: a shorter ping_s takes effect soon


def ping_interval(owner_timeout_s: float) -> float:
    """How often an idle client pings a broker that ends clients silent for
    `owner_timeout_s`: four times within it, at most every PING_S."""
    return min(PING_S, owner_timeout_s / 4)


class Client:
    """One connection to the broker, and one owner there: what it reserves, pins,
    registers and leases is its own (others are refused `not_owner`) and is let go
    when it closes or goes silent for `broker.owner_timeout_s`. While the engine is
    idle, a background thread pings every `ping_s` so that silence means gone; the
    broker's replies say its owner timeout, and a `ping_s` too long for it is
    shortened to a quarter of it (a client made with the address alone does not know
    how the node is configured)."""

    def __init__(self, address: str, timeout: float = 10.0,
                 curve: CurveClientKeys | None = None, ping_s: float = PING_S,
                 realtime_priority: int = 0) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if ping_s <= 0:
            raise ValueError(f"ping_s must be positive, got {ping_s}")
        self.address = address
        self.timeout = timeout
        self.curve = curve
        self.ping_s = ping_s
        why = check_priority(realtime_priority)
        if why is not None:
            raise ValueError(f"realtime_priority {why}")
        # The thread waiting for an answer is woken ahead of a busy host's other work,
        # and so is the I/O thread that hands it the answer: that of a context of this
        # client's own (made in `_connect`).
        self._waiting = WaitBoost(realtime_priority)
        self._own_context = bool(realtime_priority)
        self._ctx: zmq.Context | None = None if realtime_priority else zmq.Context.instance()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        # The broker knows this client by its routing id: kept when the socket is
        # rebuilt, so a reconnect is the same owner. Random, never shown: it is what
        # the broker's ownership checks rest on.
        self._routing_id = b"tkv" + secrets.token_bytes(16)
        self._lock = threading.RLock()  # the socket: the caller's thread and the pinger
        self._last_sent = time.monotonic()
        self._pinger: threading.Thread | None = None
        self._closed = threading.Event()
        self._held: list[JobResult] = []  # finished while `wait` looked for others
        self._held_events: list[OffloadEvent] = []
        self._held_dropped = 0  # `Step.events_dropped` read by `wait`, for the next step
        # The broker's CPU region as its last reply named it: a new one means a new
        # broker, which knows nothing of the old one's jobs (see `_saw_region`).
        self._region = ""
        self._broker_starts = 0  # how many times a reply named a new region
        self._posted: set[int] = set()  # requests sent by `post`, their replies not taken
        self._replies: dict[int, Reply] = {}  # replies to those, come while looking for others
        # rank -> the token of its KV registration: ours (kept to replace it, also
        # across reconnects), or another client's given by `use_kv`.
        self.registration_tokens: dict[int, str] = {}
        # What recomputing costs this engine, sent with its lookups (`recompute_rate`).
        self.prefill_tps = 0.0
        self.key_tokens = 0
        # The prefix of every key this client names (its namespace), sent with each
        # request: replies count what arrived under it (`Lookup.arrivals`). Empty:
        # every key of the node.
        self.scope = b""
        self._connect()

    @classmethod
    def from_config(cls, config: str | os.PathLike[str] | Config | None = None) -> Client:
        if not isinstance(config, Config):
            config = load_config(config)
        return cls(config.connect_address("client"), timeout=config.client.timeout_s,
                   curve=config.client.curve_keys(),
                   ping_s=ping_interval(config.broker.owner_timeout_s),
                   realtime_priority=config.client.realtime_priority)

    def recompute_rate(self, tokens_per_s: float, tokens_per_key: int) -> None:
        """Say what recomputing costs this engine: its prefill rate and the tokens one
        key covers. From then on a lookup promotes from a secondary tier only what is
        expected to arrive sooner than the engine could recompute it, and waits for
        it at most about that long (`Lookup.slower` counts what it skipped). A
        request may set its own bound instead (`RequestContext.load_budget_s`).
        `tokens_per_s` 0: every promotion is worth it (the default)."""
        if not 0 <= tokens_per_s < math.inf:
            raise ValueError(f"tokens_per_s must be a finite number >= 0, got {tokens_per_s}")
        if not 0 < tokens_per_key <= MAX_KEY_TOKENS:
            raise ValueError(f"tokens_per_key must be 1..{MAX_KEY_TOKENS}, got {tokens_per_key}")
        self.prefill_tps, self.key_tokens = float(tokens_per_s), int(tokens_per_key)

    def use_kv(self, tokens: dict[int, str]) -> None:
        """Store from and load into KV caches another client registered: the tokens
        (rank -> token) its `register_kv` returned. Without them the broker refuses
        this client's `store` and `load` (`not_owner`)."""
        self.registration_tokens.update(tokens)

    # -- one operation per round trip --------------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey], req_id: str | None = None,
               status: bool = False, pin: bool = False) -> Lookup:
        """Leading CPU hits (leased to `req_id` until it loads them, finishes, or
        `broker.lease_s` passes), and whether to ask again; `status`: also a status
        and a source per key (sliding-window and hybrid layers); `pin`: the hits are
        pinned in the same pass (their rows in `Lookup.rows`; `release` each)."""
        return self.batch().lookup(keys, req_id, status, pin).send_one()

    def store(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int],
              req_id: str | None = None) -> Store:
        """GPU -> CPU tier on every rank. `keys_accepted` are the keys actually
        stored (absent, admitted, room made); the job id is None when there are none.
        `refused` says room could not be made now (blocks in use): ask again later."""
        return self.batch().store(keys, gpu_block_ids, req_id).send_one()

    def load(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int],
             req_id: str | None = None) -> Load:
        """CPU tier -> GPU on every rank. The keys must be hits (see `lookup`)."""
        return self.batch().load(keys, gpu_block_ids, req_id).send_one()

    def reserve(self, keys: Sequence[OffloadKey], req_id: str | None = None) -> Reserve:
        """Allocate CPU blocks the engine writes itself (no copy is dispatched)."""
        return self.batch().reserve(keys, req_id).send_one()

    def commit(self, keys: Sequence[OffloadKey], ok: bool = True, region: str = "") -> None:
        """Reserved blocks were written (they become hits), or not (`ok` False: freed).
        `region`: the `SharedRegion.generation` the engine wrote into; a broker that
        serves another region refuses the commit (`stale_region`)."""
        self.batch().commit(keys, ok, region).send_one()

    def commit_as(self, reserved: Sequence[OffloadKey], keys: Sequence[OffloadKey],
                  region: str = "") -> list[bool]:
        """Reserved rows were written with the blocks of `keys` (see `Batch.commit_as`)."""
        return self.batch().commit_as(reserved, keys, region).send_one()

    def pin(self, keys: Sequence[OffloadKey], req_id: str | None = None) -> list[int]:
        """Protect ready blocks the engine reads itself; their CPU block ids."""
        return self.batch().pin(keys, req_id).send_one()

    def release(self, keys: Sequence[OffloadKey]) -> None:
        """Pinned blocks were read (a completed read counts as a use)."""
        self.batch().release(keys).send_one()

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.batch().touch(keys).send_one()

    def finish(self, req_id: str) -> None:
        """The request is done: its leased and promoted blocks lose their lease."""
        self.batch().finish(req_id).send_one()

    def step(self) -> Step:
        """End an engine step: completions are applied; returns what finished."""
        return self._with_held(self.batch().step().send_one())

    def poll(self) -> Step:
        """Finished jobs and events so far, without ending a step."""
        return self._with_held(self.batch().poll().send_one())

    def wait(self, job_ids: Sequence[int | None],
             timeout: float | None = None) -> dict[int, JobResult]:
        """Until every job in `job_ids` finished (None ids are skipped): the broker
        answers when they have, so nothing polls. Jobs that finish meanwhile but were
        not asked for are kept for the next `step`/`poll`. Raises TimeoutError naming
        the missing jobs."""
        wanted = {j for j in job_ids if j is not None}
        done: dict[int, JobResult] = {}
        limit = timeout or self.timeout
        starts = self._broker_starts
        deadline = time.monotonic() + limit
        for result in self._held[:]:
            if result.job_id in wanted:
                done[result.job_id] = result
                self._held.remove(result)
        while wanted - done.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"jobs {sorted(wanted - done.keys())} did not finish "
                                   f"within {limit:.1f}s")
            batch = self.batch().step()
            batch.wait_for(sorted(wanted - done.keys()), min(left, self.timeout / 2))
            step = batch.send_one(timeout=min(left, self.timeout / 2) + self.timeout / 2)
            if self._broker_starts != starts:
                # The jobs asked for were the old broker's: whatever finished of them
                # was never said, so none may be read as done.
                done.update((j, lost_job(j, "the broker restarted while it ran"))
                            for j in wanted - done.keys())
                break
            for result in step.finished:
                if result.job_id in wanted:
                    done[result.job_id] = result
                else:
                    self._held.append(result)
            self._held_events.extend(step.events)
            self._held_dropped += step.events_dropped
        return done

    def stats(self, verify: bool = False) -> dict[str, Any]:
        """The node's figures; `verify=True` also checks the block-state invariants
        (`result["invariants"] == "ok"`), which costs a pass over every block."""
        return self._unwrap(self._roundtrip(StatsRequest(self._id(), verify), self.timeout))

    def register_kv(
        self, rank: int, registration: dict[str, Any], timeout: float | None = None,
        token: str | None = None,
    ) -> dict[str, Any]:
        """Hand an engine's KV cache (see `tierkv.engine`) to the worker of `rank`.

        Only the engine that made a rank's registration may replace it: this client
        (it keeps the token the broker returns, also across reconnects), a client
        given that `token`, or any client once that engine has exited. A
        registration the worker cannot open leaves the working one in place."""
        token = token if token is not None else self.registration_tokens.get(rank, "")
        request = RegisterKVRequest(self._id(), rank, registration, token)
        reply = self._unwrap(self._roundtrip(request, timeout or self.timeout))
        if isinstance(reply, dict) and reply.get("token"):
            self.registration_tokens[rank] = reply["token"]
        return reply

    def batch(self) -> Batch:
        """Collect one engine step's operations and send them in one round trip:
        `b = c.batch(); b.lookup(...); b.store(...); results = b.send()`."""
        return Batch(self)

    # -- plumbing --------------------------------------------------------------------

    def close(self) -> None:
        """Say goodbye (the broker lets go of what this client holds at once) and
        close the socket."""
        self._closed.set()
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.send(encode(Bye("client closed")), flags=zmq.NOBLOCK)
                    self._sock.close(linger=100)  # time for the goodbye to leave
                except zmq.ZMQError:
                    self._sock.close(linger=0)
                self._sock = None
            if self._own_context and self._ctx is not None:
                self._ctx.term()  # its own; a call after close makes another
                self._ctx = None

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _ping(self) -> None:
        """While the engine is idle, say it is alive (the broker ends a silent client)."""
        while not self._closed.wait(min(self.ping_s / 2, PING_CHECK_S)):
            if time.monotonic() - self._last_sent < self.ping_s:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # a call is in flight: that says it
            try:
                if self._sock is not None and not self._closed.is_set():
                    self._sock.send(encode(Heartbeat()), flags=zmq.NOBLOCK)
                    self._last_sent = time.monotonic()
            except zmq.ZMQError:
                pass  # not connected: the next call finds out and says so
            finally:
                self._lock.release()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _id(self) -> int:
        return next(self._ids)

    def _saw_region(self, region: str) -> None:
        """A reply named the broker's CPU region. Another one than before means the
        broker restarted: results and events held from the old one are dropped, for
        its job ids and rows mean nothing to the new one."""
        if not region or region == self._region:
            return
        if self._region:
            self._held.clear()
            self._held_events.clear()
            self._held_dropped = 0
            self._broker_starts += 1
        self._region = region

    def _with_held(self, step: Step) -> Step:
        if not self._held and not self._held_events and not self._held_dropped:
            return step
        finished, self._held = self._held + step.finished, []
        events, self._held_events = self._held_events + step.events, []
        dropped, self._held_dropped = self._held_dropped + step.events_dropped, 0
        return Step(finished, events, step.step, dropped)

    def _connect(self) -> None:
        self._drop_socket()
        if self._ctx is None:
            self._ctx = zmq.Context(io_threads=1)
            lift_context(self._ctx, self._waiting.priority, "client")
        sock = make_socket(self._ctx, zmq.DEALER, identity=self._routing_id)
        # Messages are not queued for a broker that is not there.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.curve is not None:
            curve_client(sock, self.curve)
        connect(sock, self.address)
        self._sock = sock

    def _unwrap(self, reply: Reply) -> Any:
        if reply.owner_timeout_s > 0:  # the broker ends a client silent this long
            self.ping_s = min(self.ping_s, ping_interval(reply.owner_timeout_s))
        if not reply.ok:
            error = reply.error
            raise RemoteError(error.code if error else "unknown", error.message if error else "")
        return reply.result

    def _roundtrip(self, msg: Message, timeout: float) -> Reply:
        self._keep_alive()
        with self._lock:
            self._socket()  # made (a context's threads started) before the lift: see WaitBoost
            with self._waiting:
                self._last_sent = time.monotonic()
                return self._exchange(msg, timeout)

    def post(self, msg: Message, wait_s: float = 0.0) -> None:
        """Send `msg` and return: `collect` takes its reply. For a caller that must not
        wait (a scheduler step): it never blocks longer than `wait_s` for a
        connection, and raises BrokerUnavailable when there is none."""
        self._keep_alive()
        with self._lock:
            self._last_sent = time.monotonic()
            sock = self._socket()
            payload = encode(msg)
            try:
                sock.send(payload, flags=zmq.NOBLOCK)
            except zmq.Again:
                self._check_address()
                if not sock.poll(max(0, int(wait_s * 1000)), zmq.POLLOUT):
                    raise BrokerUnavailable(
                        f"no connection to the broker at {self.address}") from None
                sock.send(payload, flags=zmq.NOBLOCK)
            self._posted.add(msg.id)  # type: ignore[attr-defined]

    def connected(self, timeout: float) -> bool:
        """Wait up to `timeout` for the connection to the broker (a `post` made before
        it is up fails rather than wait)."""
        with self._lock:
            return bool(self._socket().poll(max(0, int(timeout * 1000)), zmq.POLLOUT))

    def collect(self, request_id: int, timeout: float = 0.0) -> Reply | None:
        """The reply to a `post`ed request, if it is there within `timeout` seconds
        (0: only look). Replies to other posted requests are kept for theirs."""
        with self._lock:
            reply = self._replies.pop(request_id, None)
            sock = self._sock
            deadline = time.monotonic() + timeout
            while reply is None and sock is not None:
                if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN and (
                        timeout <= 0 or not self._poll_in(sock, deadline)):
                    return None
                got = decode(sock.recv(flags=zmq.NOBLOCK))
                if isinstance(got, Reply) and got.id == request_id:
                    reply = got
                elif isinstance(got, Reply) and got.id in self._posted:
                    self._replies[got.id] = got
            self._posted.discard(request_id)
            return reply

    def _poll_in(self, sock: zmq.Socket, deadline: float) -> bool:
        with self._waiting:
            return bool(sock.poll(max(1, _ms_left(deadline)), zmq.POLLIN))

    def forget_posted(self) -> None:
        """Give up every posted request: the socket is made anew (what is queued on it
        is dropped), so no late reply is mistaken for another's."""
        with self._lock:
            self._posted.clear()
            self._replies.clear()
            self._connect()

    def _socket(self) -> zmq.Socket:
        """The socket, made again if a failed call dropped it."""
        if self._sock is None:
            self._connect()
        assert self._sock is not None
        return self._sock

    def _keep_alive(self) -> None:
        if self._pinger is None or self._closed.is_set():  # first call, or used after close
            self._closed.clear()
            self._pinger = threading.Thread(target=self._ping, name="tierkv-client-ping",
                                            daemon=True)
            self._pinger.start()

    def _exchange(self, msg: Message, timeout: float) -> Reply:
        sock = self._socket()
        deadline = time.monotonic() + timeout
        payload = encode(msg)
        request_id = msg.id  # type: ignore[attr-defined]
        while True:
            try:
                sock.send(payload, flags=zmq.NOBLOCK)
                break
            except zmq.Again:  # not connected (yet): say at once if nothing is there
                self._check_address()
                if not sock.poll(_ms_left(deadline), zmq.POLLOUT):
                    self._give_up(timeout)
        while True:
            # A receive with a timeout: one call, where poll-then-receive is two.
            sock.setsockopt(zmq.RCVTIMEO, max(1, _ms_left(deadline)))
            try:
                data = sock.recv()
            except zmq.Again:
                self._give_up(timeout)
            reply = decode(data)
            if isinstance(reply, Reply) and reply.id == request_id:
                return reply
            if isinstance(reply, Reply) and reply.id in self._posted:
                self._replies[reply.id] = reply  # a posted request's: `collect` takes it
            # Else a stale reply to an earlier call that timed out: skip it.

    def _check_address(self) -> None:
        path = ipc_path(self.address)
        if path is not None and not path.exists():
            raise BrokerUnavailable(
                f"no broker at {self.address}: the socket file does not exist (is the node "
                "running? `tierkv status -c FILE` says)")

    def _give_up(self, timeout: float) -> None:
        # Drop whatever is queued (posted requests' replies with it); a restarted
        # broker is found again.
        self.forget_posted()
        raise BrokerUnavailable(
            f"no broker reply from {self.address} within {timeout:.1f}s (client.timeout_s)"
        )


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
