"""The scheduler's one connection to the tierkv broker, with no thread of its own.

vLLM calls the manager on its scheduler thread, where every millisecond spent
waiting is a millisecond of every running request's step. So a call is sent and
left: the broker works on it while the scheduler goes on, its reply waits in
ZeroMQ's queue (filled by libzmq's own I/O thread, which needs no Python lock), and
the manager takes it when it next looks (`pump`, a check of the socket), or waits
for it at most as long as its step budget allows (`Call.wait`). There is no link
thread on purpose: a Python thread that receives replies needs the interpreter's
lock, which the scheduler thread holds while it works, so every reply it handled
came up to a switch interval (5 ms) late, longer than the round trip itself.

Calls are answered in the order they were sent (one connection, one broker loop),
so a commit sent before a lookup is applied before it. A call still out when its
wait ends is *abandoned*, not lost: its reply is taken when it comes and the call is
handed back through `take_late`, so the manager can undo what it no longer wants
(release the pins of a lookup nobody was told about, abort a reservation no store
will write). Only a call with no reply within the client's `timeout_s` ends with
`BrokerUnavailable`, and every call sent after it with it (the connection is made
anew, dropping what it held); what they did at the broker is then unknown, and the
broker's own deadlines (`broker.reservation_s`, `broker.pin_s`) bound what it may
still hold.

Every reply names the broker's CPU region, new at each broker start: the link keeps
the last one (`region`) and when it last heard from the broker (`heard_at`), so the
manager can tell that rows it holds from before belong to a broker that is gone.
It keeps the last reply's count of arrivals (`OpsResult.arrivals`) too: while that
has not moved, a miss the manager was told is still one.

Everything here runs on the thread that holds the manager's lock.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from tierkv.client import Batch, BrokerUnavailable, Client, RemoteError
from tierkv.wire.protocol import OpsResult, ProtocolError

log = logging.getLogger("tierkv.vllm")

CLOSE_WAIT_S = 5.0  # how long `close` waits for the calls still out
CONNECT_WAIT_S = 0.002  # a send waits this long at most for a connection
FAILURES = (BrokerUnavailable, RemoteError, ProtocolError, ValueError)


class Call:
    """One round trip: its batch, what it carries, and how it ended.

    `carried` is the manager's record of what the batch holds (deferred operations,
    lookups, reservations) so that it can settle them whichever way the call ends;
    the link never reads it."""

    __slots__ = ("_abandoned", "_done", "_link", "batch", "carried", "error", "request_id",
                 "results", "sent_at")

    def __init__(self, link: BrokerLink, batch: Batch, carried: Any) -> None:
        self._link = link
        self.batch = batch
        self.carried = carried
        self.results: list[Any] | None = None
        self.error: Exception | None = None
        self.sent_at = time.monotonic()
        self.request_id = 0
        self._done = False
        self._abandoned = False

    @property
    def done(self) -> bool:
        return self._done

    def wait(self, seconds: float) -> bool:
        """Whether the call ended within `seconds` (0: only look)."""
        return self._done or self._link.pump(self, seconds)

    def abandon(self) -> bool:
        """Give the call up: its end comes back through `BrokerLink.take_late`.
        False if it had ended already (then its results are the caller's)."""
        if self._done:
            return False
        self._abandoned = True
        return True

    def _end(self, results: list[Any] | None, error: Exception | None,
             late: list[Call]) -> None:
        self.results, self.error, self._done = results, error, True
        if self._abandoned:
            late.append(self)


class BrokerLink:
    """Calls to the broker, sent at once and answered in order."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._out: deque[Call] = deque()  # sent, not answered, oldest first
        self._late: list[Call] = []
        self.region = ""  # the broker's CPU region, as its last reply named it
        self.arrivals = -1  # `OpsResult.arrivals`, as its last reply said it
        self.heard_at = 0.0  # when a reply last came (monotonic)
        # At start, not in a step: the first calls find the connection up (one that
        # is not sends nothing and the manager goes on without the broker a while).
        client.connected(client.timeout)

    def batch(self) -> Batch:
        return self.client.batch()

    def send(self, batch: Batch, carried: Any = None) -> Call:
        """Send `batch`; returns at once (a call that cannot be sent has ended)."""
        call = Call(self, batch, carried)
        try:
            request = batch.request(self.client._id())
            call.request_id = request.id
            self.client.post(request, CONNECT_WAIT_S)
        except FAILURES as e:
            call._end(None, e, self._late)
            return call
        self._out.append(call)
        return call

    def wait_oldest(self, seconds: float) -> None:
        """Wait up to `seconds` for the oldest call out (if any) to end."""
        if self._out:
            self.pump(self._out[0], seconds)

    def stalled(self, seconds: float) -> bool:
        """The oldest call out has been out longer than `seconds`."""
        return bool(self._out) and time.monotonic() - self._out[0].sent_at > seconds

    def pump(self, until: Call | None = None, seconds: float = 0.0) -> bool:
        """Take the replies that are there, or that come within `seconds` while
        `until` is still out; True if `until` (when given) has ended."""
        deadline = time.monotonic() + seconds
        out = self._out
        while out:
            call = out[0]
            now = time.monotonic()
            wait = 0.0
            if until is not None and not until.done:  # no longer than this call may take
                wait = min(deadline, call.sent_at + self.client.timeout) - now
            reply = self.client.collect(call.request_id, max(wait, 0.0))
            if reply is None:
                if time.monotonic() - call.sent_at >= self.client.timeout:
                    self._lost()
                    continue  # `until` ended with them
                if wait <= 0 or time.monotonic() >= deadline:
                    break
                continue  # the oldest call may take longer than this wait: look again
            out.popleft()
            self._heard(reply)
            try:
                call._end(call.batch.read(reply), None, self._late)
            except FAILURES as e:
                call._end(None, e, self._late)
            except Exception as e:  # never let a bad reply end the engine: the manager sees it
                log.exception("tierkv: a broker reply could not be read")
                call._end(None, e, self._late)
        return until is None or until.done

    def take_late(self) -> list[Call]:
        """Abandoned calls that have ended since the last look."""
        if self._out:
            self.pump()
        late, self._late = self._late, []
        return late

    def close(self) -> None:
        """Wait for the calls still out (bounded), then close the client, which tells
        the broker this engine is gone."""
        if self._out and not self.pump(self._out[-1], CLOSE_WAIT_S):
            log.warning("tierkv: %d broker calls were still out after %.0fs at shutdown",
                        len(self._out), CLOSE_WAIT_S)
        self.client.close()

    def _heard(self, reply: Any) -> None:
        self.heard_at = time.monotonic()
        region, arrivals = _said(reply)
        if region:
            self.region, self.arrivals = region, arrivals

    def _lost(self) -> None:
        """The oldest call had no reply within the client's timeout: it and every call
        after it end unanswered, and the connection is made anew."""
        error = BrokerUnavailable(f"no broker reply from {self.client.address} within "
                                  f"{self.client.timeout:.1f}s (client.timeout_s)")
        calls = list(self._out)
        self._out.clear()
        self.client.forget_posted()
        for call in calls:
            call._end(None, error, self._late)


def _said(reply: Any) -> tuple[str, int]:
    """The CPU region an `ops` reply names and its count of arrivals
    (`OpsResult.arrivals`); ("", -1) for a refusal, which says neither."""
    result = getattr(reply, "result", None)
    if isinstance(result, OpsResult):
        return result.region, result.arrivals
    if isinstance(result, dict):
        region, arrivals = result.get("region", ""), result.get("arrivals", -1)
        return (region if isinstance(region, str) else "",
                arrivals if type(arrivals) is int else -1)
    return "", -1
