"""The scheduler-side API: talk to a tierkv broker over ZeroMQ.

    from tierkv.client import Client
    c = Client.from_config("tierkv.toml")      # or Client("ipc:///run/.../client.sock")
    hit = c.lookup(keys, req_id="r1")          # Lookup(hits, pending)
    s = c.store(keys, gpu_block_ids, req_id="r1")
    done = c.step()                            # Step(finished, events)

Every call waits at most `timeout` seconds and then raises `BrokerUnavailable`
(the socket is rebuilt, so a broker that restarts is found again). A refusal by
the broker is a `RemoteError` with a `code` from `tierkv.core.errors.ErrorCode`.
A `Client` is not thread-safe: one per thread.

Ordering contract for stores: call `store` only after the engine step that
wrote those GPU blocks has synchronized its output; the worker reads them as soon
as the job arrives. A `load` has landed in the GPU blocks when its job is in a
`Step.finished` with `success=True`.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import zmq

from tierkv.core.keys import OffloadKey, check_keys
from tierkv.node.config import Config, load_config
from tierkv.wire.protocol import (
    BatchRequest,
    BatchResult,
    FinishRequest,
    LoadRequest,
    LoadResult,
    LookupRequest,
    LookupResult,
    Message,
    PollRequest,
    ProtocolError,
    RegisterKVRequest,
    Reply,
    StatsRequest,
    StepRequest,
    StepResult,
    StoreRequest,
    StoreResult,
    TouchRequest,
    TransferResult,
    decode,
    encode,
    to_map,
    to_record,
)
from tierkv.wire.sockets import CurveClientKeys, connect, curve_client, ipc_path, make_socket

# The names of DESIGN's public API.
Lookup = LookupResult
Store = StoreResult
Load = LoadResult
Step = StepResult
JobResult = TransferResult

T = TypeVar("T")

__all__ = ["BrokerUnavailable", "Client", "JobResult", "Load", "Lookup", "ProtocolError",
           "RemoteError", "Step", "Store"]


class BrokerUnavailable(ConnectionError):
    """No reply from the broker within the call's timeout."""


class RemoteError(RuntimeError):
    """The broker refused a request."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class Client:
    def __init__(self, address: str, timeout: float = 10.0,
                 curve: CurveClientKeys | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.address = address
        self.timeout = timeout
        self.curve = curve
        self._ctx: zmq.Context = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._held: list[JobResult] = []  # finished while `wait` looked for others
        self._held_events: list[Any] = []
        self.registration_tokens: dict[int, str] = {}  # rank -> what replaces ours
        self._connect()

    @classmethod
    def from_config(cls, config: str | os.PathLike[str] | Config | None = None) -> Client:
        if not isinstance(config, Config):
            config = load_config(config)
        return cls(config.connect_address("client"), timeout=config.client.timeout_s,
                   curve=config.client.curve_keys())

    # -- the API -------------------------------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey], req_id: str | None = None) -> Lookup:
        return self._call(LookupRequest(self._id(), check_keys(keys), req_id), Lookup)

    def store(
        self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int], req_id: str | None = None
    ) -> Store:
        """GPU -> CPU tier on every rank. `keys_accepted` are the keys actually
        stored (absent, admitted, room made); the job id is None when there are none.
        `refused` says room could not be made now (blocks in use): ask again later."""
        return self._call(
            StoreRequest(self._id(), check_keys(keys), list(gpu_block_ids), req_id), Store
        )

    def load(
        self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int], req_id: str | None = None
    ) -> Load:
        """CPU tier -> GPU on every rank. The keys must be hits (see `lookup`)."""
        return self._call(
            LoadRequest(self._id(), check_keys(keys), list(gpu_block_ids), req_id), Load
        )

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._call(TouchRequest(self._id(), check_keys(keys)), None)

    def finish(self, req_id: str) -> None:
        """The request is done: its promoted blocks lose their lease."""
        self._call(FinishRequest(self._id(), req_id), None)

    def step(self) -> Step:
        """End an engine step: completions are applied; returns what finished."""
        return self._with_held(self._call(StepRequest(self._id()), Step))

    def poll(self) -> Step:
        """Finished jobs and events so far, without ending a step."""
        return self._with_held(self._call(PollRequest(self._id()), Step))

    def wait(self, job_ids: Sequence[int | None], timeout: float | None = None,
             interval: float = 0.002) -> dict[int, JobResult]:
        """Step until every job in `job_ids` finished (None ids are skipped).
        Jobs that finish meanwhile but were not asked for are kept for the next
        `step`/`poll`. Raises TimeoutError naming the missing jobs."""
        wanted = {j for j in job_ids if j is not None}
        done: dict[int, JobResult] = {}
        deadline = time.monotonic() + (timeout or self.timeout)
        while wanted - done.keys():
            step = self._call(StepRequest(self._id()), Step)
            for result in step.finished:
                if result.job_id in wanted:
                    done[result.job_id] = result
                else:
                    self._held.append(result)
            self._held_events.extend(step.events)
            if wanted - done.keys():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"jobs {sorted(wanted - done.keys())} did not finish "
                                       f"within {timeout or self.timeout:.1f}s")
                time.sleep(interval)
        return done

    def stats(self, verify: bool = False) -> dict[str, Any]:
        """The node's figures; `verify=True` also checks the block-state invariants
        (`result["invariants"] == "ok"`), which costs a pass over every block."""
        return self._call(StatsRequest(self._id(), verify), None)

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
        reply = self._call(RegisterKVRequest(self._id(), rank, registration, token), None,
                           timeout)
        if isinstance(reply, dict) and reply.get("token"):
            self.registration_tokens[rank] = reply["token"]
        return reply

    def batch(self) -> Batch:
        """Collect operations and send them in one round trip: `b = c.batch();
        b.lookup(...); b.store(...); results = b.send()`."""
        return Batch(self)

    # -- plumbing --------------------------------------------------------------------

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _id(self) -> int:
        return next(self._ids)

    def _with_held(self, step: Step) -> Step:
        if not self._held and not self._held_events:
            return step
        finished, self._held = self._held + step.finished, []
        events, self._held_events = self._held_events + step.events, []
        return Step(finished, events, step.step)

    def _connect(self) -> None:
        self.close()
        sock = make_socket(self._ctx, zmq.DEALER)
        # Messages are not queued for a broker that is not there.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.curve is not None:
            curve_client(sock, self.curve)
        connect(sock, self.address)
        self._sock = sock

    def _call(self, msg: Message, result_type: type[T] | None,
              timeout: float | None = None) -> Any:
        reply = self._roundtrip(msg, timeout or self.timeout)
        return _unwrap(reply, result_type)

    def _roundtrip(self, msg: Message, timeout: float) -> Reply:
        if self._sock is None:
            self._connect()
        sock = self._sock
        assert sock is not None
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
            if not sock.poll(_ms_left(deadline), zmq.POLLIN):
                self._give_up(timeout)
            reply = decode(sock.recv())
            if isinstance(reply, Reply) and reply.id == request_id:
                return reply
            # A stale reply to an earlier call that timed out: skip it.

    def _check_address(self) -> None:
        path = ipc_path(self.address)
        if path is not None and not path.exists():
            raise BrokerUnavailable(
                f"no broker at {self.address}: the socket file does not exist (is the node "
                "running? `tierkv status -c FILE` says)")

    def _give_up(self, timeout: float) -> None:
        self._connect()  # drop whatever is queued; a restarted broker is found again
        raise BrokerUnavailable(
            f"no reply from the broker at {self.address} within {timeout:.1f}s "
            "(client.timeout_s)"
        )


class Batch:
    """Operations of one engine step, sent together and run in order."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._ops: list[tuple[Message, type | None]] = []

    def lookup(self, keys: Sequence[OffloadKey], req_id: str | None = None) -> Batch:
        self._ops.append((LookupRequest(0, check_keys(keys), req_id), Lookup))
        return self

    def store(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int],
              req_id: str | None = None) -> Batch:
        self._ops.append((StoreRequest(0, check_keys(keys), list(gpu_block_ids), req_id), Store))
        return self

    def load(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int],
             req_id: str | None = None) -> Batch:
        self._ops.append((LoadRequest(0, check_keys(keys), list(gpu_block_ids), req_id), Load))
        return self

    def touch(self, keys: Sequence[OffloadKey]) -> Batch:
        self._ops.append((TouchRequest(0, check_keys(keys)), None))
        return self

    def finish(self, req_id: str) -> Batch:
        self._ops.append((FinishRequest(0, req_id), None))
        return self

    def step(self) -> Batch:
        self._ops.append((StepRequest(0), Step))
        return self

    def send(self) -> list[Any]:
        """One result per operation, in order; a refused operation's slot holds its
        `RemoteError` (the others still ran)."""
        ops, self._ops = self._ops, []
        request = BatchRequest(self._client._id(), [to_map(m) for m, _ in ops])
        batch: BatchResult = self._client._call(request, BatchResult)
        results: list[Any] = []
        for (_, result_type), reply in zip(ops, batch.results, strict=True):
            try:
                results.append(_unwrap(reply, result_type))
            except RemoteError as e:
                results.append(e)
        return results

    def __len__(self) -> int:
        return len(self._ops)


def _unwrap(reply: Reply, result_type: type[T] | None) -> Any:
    if not reply.ok:
        error = reply.error
        raise RemoteError(error.code if error else "unknown", error.message if error else "")
    if result_type is None or reply.result is None:
        return reply.result
    if isinstance(reply.result, result_type):
        return reply.result
    return to_record(result_type, reply.result)


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
