"""The scheduler's one connection to the tierkv broker, on a thread of its own.

vLLM calls the manager on its scheduler thread, where every millisecond spent
waiting is a millisecond of every running request's step. So the manager never
talks to the broker itself: it hands a `Batch` to this link and waits for the
answer at most as long as its step budget allows (`Call.wait`). A call that is
still out when the wait ends is *abandoned*, not lost: the link thread keeps
waiting for its reply (up to the client's `timeout_s`) and, when it comes, hands
the call back through `take_late`, so the manager can undo what it no longer
wants (release the pins of a lookup nobody was told about, abort a reservation
no store will write) on its own thread. Only a call that gets no reply at all
within `timeout_s` ends with `BrokerUnavailable`; what it did at the broker is
then unknown, and the broker's own deadlines (`broker.reservation_s`,
`broker.pin_s`) bound what it may still hold.

Calls run one at a time, in the order given: a commit sent before a lookup is
applied before it.

Threads: `send`, `take_late`, `busy` and `close` are called by the manager (under
its lock); `Call.wait` and `Call.abandon` by the thread that sent the call. The
link thread alone touches the client's socket.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from tierkv.client import Batch, BrokerUnavailable, Client, RemoteError
from tierkv.wire.protocol import ProtocolError

log = logging.getLogger("tierkv.vllm")

CLOSE_WAIT_S = 5.0  # how long `close` waits for the call in flight
MAX_MERGED = 64  # lookup calls in one round trip, at most


class Call:
    """One round trip: its batch, what it carries, and how it ended.

    `carried` is the manager's record of what the batch holds (deferred operations,
    lookups, reservations) so that it can settle them whichever way the call ends;
    the link never reads it."""

    __slots__ = ("_abandoned", "_done", "_lock", "batch", "carried", "error", "mergeable",
                 "results", "sent_at")

    def __init__(self, batch: Batch, carried: Any, mergeable: bool = False) -> None:
        self.batch = batch
        self.carried = carried
        self.mergeable = mergeable  # lookups only: may share a round trip with others
        self.results: list[Any] | None = None
        self.error: Exception | None = None
        self.sent_at = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, seconds: float) -> bool:
        """Whether the call ended within `seconds` (0: only look)."""
        return self._done.is_set() or (seconds > 0 and self._done.wait(seconds))

    def abandon(self) -> bool:
        """Give the call up: its end comes back through `BrokerLink.take_late`.
        False if it had ended already (then its results are the caller's)."""
        with self._lock:
            if self._done.is_set():
                return False
            self._abandoned = True
            return True

    def _end(self, results: list[Any] | None, error: Exception | None,
             late: queue.SimpleQueue[Call]) -> None:
        with self._lock:
            self.results, self.error = results, error
            self._done.set()
            if self._abandoned:
                late.put(self)


class BrokerLink:
    """A thread that sends `Call`s to the broker, one at a time."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._late: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self._out = 0  # calls sent and not ended (read by the manager's thread)
        self._started: float | None = None  # when the call in flight was sent
        self._out_lock = threading.Lock()
        self._next: Call | None = None  # taken from the queue while merging, not merged
        self._thread = threading.Thread(target=self._run, name="tierkv-vllm-link",
                                        daemon=True)
        self._thread.start()

    def batch(self) -> Batch:
        return self.client.batch()

    def send(self, batch: Batch, carried: Any = None, mergeable: bool = False) -> Call:
        """Queue `batch`; returns at once. Calls queued back to back that are all
        `mergeable` (lookups only) go in one round trip."""
        call = Call(batch, carried, mergeable)
        with self._out_lock:
            self._out += 1
        self._calls.put(call)
        return call

    @property
    def busy(self) -> bool:
        """A call is queued or in flight (a new one would wait behind it)."""
        return self._out > 0

    def stalled(self, seconds: float) -> bool:
        """The call in flight has been out longer than `seconds`."""
        started = self._started
        return self._out > 0 and started is not None and time.monotonic() - started > seconds

    def take_late(self) -> list[Call]:
        """Abandoned calls that have ended since the last look."""
        late: list[Call] = []
        if self._late.empty():  # the common case, on every lookup without an answer
            return late
        while True:
            try:
                late.append(self._late.get_nowait())
            except queue.Empty:
                return late

    def close(self) -> None:
        """Stop the thread (after the call in flight, bounded) and close the client,
        which tells the broker this engine is gone."""
        self._calls.put(None)
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning("tierkv: a broker call was still out after %.0fs at shutdown",
                        CLOSE_WAIT_S)
        self.client.close()

    # -- the link thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            call, self._next = self._next or self._calls.get(), None
            if call is None:
                return
            calls = self._merged(call)
            batch = call.batch
            starts = [0]
            if len(calls) > 1:
                batch = self.client.batch()
                starts = [batch.extend(c.batch) for c in calls]
            results: list[Any] | None = None
            error: Exception | None = None
            self._started = time.monotonic()
            try:
                results = batch.send()
            except (BrokerUnavailable, RemoteError, ProtocolError, ValueError) as e:
                error = e
            except Exception as e:  # never let the link die: the manager sees the error
                log.exception("tierkv: a broker call failed")
                error = e
            self._started = None
            with self._out_lock:
                self._out -= len(calls)
            starts.append(len(batch))
            for i, each in enumerate(calls):
                each._end(None if results is None else results[starts[i]:starts[i + 1]],
                          error, self._late)

    def _merged(self, call: Call) -> list[Call]:
        """`call` and the mergeable calls queued right behind it (if it is one)."""
        calls = [call]
        while call.mergeable and len(calls) < MAX_MERGED:
            try:
                following = self._calls.get_nowait()
            except queue.Empty:
                break
            if following is None:  # `close`: after these
                self._calls.put(None)
                break
            if not following.mergeable:
                self._next = following
                break
            calls.append(following)
        return calls

