"""What every worker-side process shares: its link to the broker and its lifetime.

`BrokerLink` is one DEALER session: hello -> welcome (or refused), heartbeats that
ride the data socket (any message counts; one is sent only after an idle
interval), and the verdict "broker lost" after 3 silent intervals.

`PeerService` runs sessions in a loop: when the broker is lost the process closes
its socket, backs off exponentially and says hello again (a restarted broker has a
new region, so a session attaches it anew). It stops on SIGTERM/SIGINT (handlers
only flip a flag) or when the supervisor's lifeline closes, and says so in one line.

A broker that says goodbye is stopping in order: at a node's clean stop that is
the moment before the supervisor stops this process too, so it is no warning
(a stop used to end with one "lost the broker ... reconnecting" per peer). Only an
outage that lasts (`QUIET_WAIT_S`) is logged, once, at info.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from types import FrameType

import zmq

from tierkv.core.loglimit import RateLimitedLog, foreign
from tierkv.core.shm import RegionError, SharedRegion
from tierkv.node.children import take_token
from tierkv.node.lifecycle import SUPERVISED_ENV, lifeline_fd, notify_ready, parent_gone
from tierkv.wire.protocol import (
    Bye,
    Heartbeat,
    Message,
    ProtocolError,
    Refused,
    Welcome,
    decode,
    encode,
)
from tierkv.wire.sockets import CurveClientKeys, connect, curve_client, make_socket
from tierkv.wire.wakeup import Wakeup

log = logging.getLogger("tierkv.link")
_limited = RateLimitedLog(log)  # what the broker sends is logged at most this often

QUIET_WAIT_S = 2.0  # a broker gone in order this long is worth a line


class BrokerLost(Exception):
    """The broker stopped answering or said goodbye; reconnect."""


class BrokerStopped(BrokerLost):
    """The broker said goodbye: it is stopping in order (and may come back)."""


class LinkRefused(Exception):
    """The broker refused our hello; the reason is the message."""


class BrokerLink:
    def __init__(self, address: str, identity: bytes, heartbeat_s: float,
                 allowed: frozenset[str], curve: CurveClientKeys | None = None) -> None:
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.allowed = allowed
        self.sock = make_socket(zmq.Context.instance(), zmq.DEALER, identity=identity)
        if curve is not None:
            curve_client(self.sock, curve)
        connect(self.sock, address)
        self.last_seen = time.monotonic()
        self.last_sent = 0.0
        self.welcome: Welcome | None = None

    def handshake(self, hello: Message, timeout: float, *after_hello: Message,
                  stopping: Callable[[], bool] = lambda: False) -> Welcome:
        """Send hello (and the messages that belong with it), wait for the answer."""
        self.send(hello)
        for msg in after_hello:
            self.send(msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if stopping():
                raise BrokerLost("stopping before the broker answered")
            for msg in self.receive(min(0.2, deadline - time.monotonic())):
                if isinstance(msg, Welcome):
                    self.welcome = msg
                    self.heartbeat_s = msg.heartbeat_s
                    return msg
                if isinstance(msg, Refused):
                    raise LinkRefused(msg.reason)
        raise BrokerLost(f"no welcome from {self.address} within {timeout:.0f}s")

    def send(self, msg: Message) -> None:
        try:
            self.sock.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise BrokerLost("the broker is not taking messages") from None
        self.last_sent = time.monotonic()

    def receive(self, timeout: float, wakeup: Wakeup | None = None) -> Iterator[Message]:
        """Messages that arrive within `timeout` (all that are queued, once one is).
        Returns early, with none, when `wakeup` is notified."""
        if wakeup is None:
            if not self.sock.poll(max(0, int(timeout * 1000))):
                return
        else:
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            poller.register(wakeup.fd, zmq.POLLIN)
            ready = dict(poller.poll(max(0, int(timeout * 1000))))
            if wakeup.fd in ready:
                wakeup.drain()
            if self.sock not in ready:
                return
        while True:
            try:
                payload = self.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_seen = time.monotonic()
            try:
                msg = decode(payload, self.allowed)
            except ProtocolError as e:
                _limited.warning(("malformed", type(e).__name__),
                                 "dropped a malformed message from the broker: %s", foreign(e))
                continue
            if isinstance(msg, Bye):
                raise BrokerStopped(f"the broker said goodbye ({foreign(msg.reason)})")
            if isinstance(msg, Refused) and self.welcome is not None:
                # A broker restarted on the same address answers this session's
                # heartbeats with "say hello first". As traffic they would keep
                # `last_seen` fresh: the peer would never say hello again.
                raise BrokerLost(
                    f"the broker no longer knows this session ({foreign(msg.reason)})")
            if isinstance(msg, Heartbeat):
                continue
            yield msg

    def keep_alive(self) -> None:
        now = time.monotonic()
        if now - self.last_seen > 3 * self.heartbeat_s:
            raise BrokerLost(f"broker silent for {now - self.last_seen:.1f}s")
        if now - self.last_sent >= self.heartbeat_s:
            self.send(Heartbeat())

    def close(self, reason: str = "") -> None:
        try:
            if reason:
                self.sock.send(encode(Bye(reason)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.sock.close(linger=0)


class PeerService(ABC):
    """A process that serves the broker: a gpu worker or a tier process."""

    component = "peer"

    def __init__(self, instance: str, address: str, heartbeat_s: float,
                 connect_timeout_s: float) -> None:
        self.instance = instance
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.connect_timeout_s = connect_timeout_s
        self.stopping = False
        self.sessions = 0
        self.token = take_token()  # proves to the broker that the supervisor started us
        self._lifeline = lifeline_fd()
        self._announced = False

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def run(self) -> int:
        code = self._run()
        log.info("%s (pid %d) stopped", self.component, os.getpid())
        return code

    def _run(self) -> int:
        backoff = 0.1
        gone_since: float | None = None  # when the broker went away in order
        while not self.stopping:
            try:
                region = self._attach_region()
            except RegionError as e:
                if self._wait(backoff):
                    break
                backoff = min(backoff * 2, 5.0)
                gone_since = self._still_waiting(gone_since, e)
                continue
            self.sessions += 1
            link: BrokerLink | None = None
            try:
                link = self.open_session(region)
                backoff, gone_since = 0.1, None
                if not self._announced:
                    notify_ready(f"{self.component} session {self.sessions}")
                    self._announced = True
                self.serve(link)
            except LinkRefused as e:
                log.error("the broker refused us: %s", e)
                self.end_session(region)
                return 1
            except BrokerStopped as e:
                log.debug("%s; saying hello again when it is back", e)
                gone_since = time.monotonic()
            except BrokerLost as e:
                log.warning("lost the broker: %s; reconnecting", e)
            finally:
                if link is not None:
                    link.close("stopping" if self.stopping else "")
            self.end_session(region)
            if not self.stopping and self._wait(backoff):
                break
            backoff = min(backoff * 2, 5.0)
        return 0

    def _still_waiting(self, gone_since: float | None, why: Exception) -> float | None:
        """One info line once a broker that stopped in order has stayed away
        `QUIET_WAIT_S` (at a node's stop this process is stopped before that)."""
        if gone_since is None:
            log.info("waiting for the broker: %s", why)
            return float("inf")  # said: not again this outage
        if time.monotonic() - gone_since >= QUIET_WAIT_S:
            log.info("the broker stopped %.0fs ago and is not back yet: %s",
                     time.monotonic() - gone_since, why)
            return float("inf")
        return gone_since

    def _attach_region(self) -> SharedRegion:
        region = SharedRegion.attach(self.instance, populate=True)
        if os.environ.get(SUPERVISED_ENV) and not region.owner_alive:
            # The region of a broker that died: holding its pages would keep the
            # new broker's from fitting in /dev/shm. A child of the supervisor
            # shares the broker's pid namespace, so "dead" means dead.
            name = region.name
            region.close()
            raise RegionError(f"{name} is a dead broker's: waiting for the new one")
        return region

    def _wait(self, seconds: float) -> bool:
        """Sleep unless asked to stop; True if we should stop."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stopping or self.parent_died(0):
                return True
            time.sleep(min(0.05, seconds))
        return self.stopping

    def parent_died(self, timeout: float) -> bool:
        if self._lifeline is None:
            return False
        import select

        readable, _, _ = select.select([self._lifeline], [], [], timeout)
        if readable and parent_gone(self._lifeline):
            log.warning("supervisor is gone: stopping")
            self.stopping = True
            self._lifeline = None
            return True
        return False

    def identity(self) -> bytes:
        return f"{self.component}:{os.getpid()}:{self.sessions}".encode()

    @abstractmethod
    def open_session(self, region: SharedRegion) -> BrokerLink:
        """Say hello with this region; return the welcomed link."""

    @abstractmethod
    def serve(self, link: BrokerLink) -> None:
        """Serve until stopping (return) or the broker is lost (raise BrokerLost)."""

    @abstractmethod
    def end_session(self, region: SharedRegion) -> None:
        """Release everything that views `region`, then close it."""
