"""The broker process: `python -m broker -c tierkv.toml` or `tierkv-broker`.

A thin wrapper that only moves socket traffic for `BrokerCore`: three ROUTER
sockets (clients, gpu workers, tier processes) on one poll loop, plus the
supervisor's lifeline. Signal handlers only flip a flag; the loop drains in-flight
work within `broker.drain_timeout_s`, says goodbye, closes the sockets, unlinks
the shared region and the socket files, and exits 0.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import time
from collections import OrderedDict
from types import FrameType

import zmq

from broker.core import BrokerCore, RunState
from broker.metrics import BrokerMetrics
from broker.remote_tier import RemoteTier
from tierkv.core.costs import prior_for
from tierkv.core.keys import OffloadEvent
from tierkv.core.loglimit import RateLimitedLog, foreign
from tierkv.core.primary import PrimaryTier
from tierkv.core.reuse import ReuseFilter
from tierkv.core.shm import RegionError, SharedRegion
from tierkv.core.tiering import TieringManager
from tierkv.node.children import tier_secret
from tierkv.node.config import Config, ConfigError, tier_name
from tierkv.node.lifecycle import lifeline_fd, notify_ready, parent_gone
from tierkv.node.process import process_parser, start_process
from tierkv.node.realtime import enter_realtime, lift_context
from tierkv.wire.protocol import (
    CLIENT_OPS,
    TIER_OPS,
    WORKER_OPS,
    EventBatch,
    Message,
    ProtocolError,
    decode,
    encode,
    peek_id,
)
from tierkv.wire.sockets import (
    AddressError,
    CurveError,
    bind,
    curve_server,
    ensure_run_dir,
    make_socket,
    remove_ipc_file,
    start_authenticator,
)

log = logging.getLogger("broker")

MAX_MESSAGES_PER_WAKEUP = 2000
MAX_REQ_PEERS = 65536  # REQ identities remembered for their envelope (the oldest go)
METRICS_S = 0.5  # how often the metrics endpoint's snapshot is refreshed
LIVENESS_S = 0.05  # how often silent peers, overdue jobs and waiting replies are checked


class Timer:
    """Due every `interval_s` on the monotonic clock."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next = 0.0

    def left(self) -> float:
        return max(0.0, self._next - time.monotonic())

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True


class BrokerProc:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.stop_requested = False
        self.sockets: dict[str, zmq.Socket] = {}
        self.events_sock: zmq.Socket | None = None
        self.auth = None
        self._bound: list[str] = []  # addresses bound: their socket files are ours
        ensure_run_dir(config.run_path)
        cpu = config.cpu
        self.region = SharedRegion.create(config.instance, cpu.num_blocks, cpu.page_size,
                                          cpu.world_size, prefault=cpu.prefault)
        try:
            reuse = ReuseFilter(cpu.reuse_threshold) if cpu.reuse_threshold else None
            primary = PrimaryTier(cpu.num_blocks, cpu.policy, reuse_filter=reuse)
            clock = time.monotonic
            self.remote = {
                tier_name(entry): RemoteTier(
                    tier_name(entry), self._send_tier, clock, config.broker.job_timeout_s,
                    negative_ttl_s=float(entry.get("negative_ttl_s", 2.0)),
                    fence_grace_s=3 * config.broker.heartbeat_s,
                )
                for entry in config.tiers
            }
            priors = [prior_for(entry["type"], float(entry.get("load_latency_ms", 0.0)),
                                float(entry.get("load_bandwidth_mb_s", 0.0)))
                      for entry in config.tiers]
            manager = TieringManager(primary, list(self.remote.values()),
                                     lease_s=config.broker.lease_s, region=self.region,
                                     cost_priors=priors,
                                     max_cascade_backlog=cpu.cascade_backlog_blocks
                                     or max(64, cpu.num_blocks // 4))
            self.core = BrokerCore(config, manager, self.remote, self._send, clock,
                                   publish=self._publish if config.broker.events_address
                                   else None,
                                   tier_secret=tier_secret(config.tier_secret_path))
            # The metrics port first: if it is taken, no socket file is made at all.
            self.metrics = BrokerMetrics(config.broker.metrics_port) \
                if config.broker.metrics_port else None
            self._open_sockets()
            enter_realtime(config.broker.realtime_priority, "broker")
        except BaseException:
            self._close_sockets()
            metrics = getattr(self, "metrics", None)
            if metrics is not None:
                metrics.close()
            self.region.close()
            self.region.unlink()
            raise

    def _open_sockets(self) -> None:
        self.ctx: zmq.Context = zmq.Context.instance()
        lift_context(self.ctx, self.config.broker.realtime_priority, "broker")
        self.addresses = {link: self.config.address(link) for link in ("client", "worker", "tier")}
        secret = self.config.broker.curve_secret_file
        self.auth = start_authenticator(self.ctx, self.config.broker.curve_authorized_dir) \
            if secret else None
        for link, address in self.addresses.items():
            sock = make_socket(self.ctx, zmq.ROUTER)
            if link == "client":
                # A client keeps its (random, secret) routing id when it rebuilds its
                # socket: the new connection takes the old one's place, as its owner.
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self.sockets[link] = sock
            if secret:
                curve_server(sock, secret)
            bind(sock, address, curve=bool(secret))
            self._bound.append(address)
        self._links = {sock: link for link, sock in self.sockets.items()}
        self._event_seq = 0
        if self.config.broker.events_address:
            self.events_sock = make_socket(self.ctx, zmq.PUB)
            if secret:
                curve_server(self.events_sock, secret)
            bind(self.events_sock, self.config.broker.events_address, curve=bool(secret))
            self._bound.append(self.config.broker.events_address)
        self._req_peers: OrderedDict[bytes, None] = OrderedDict()  # identities that use REQ
        self._warn = RateLimitedLog(log)  # what a peer can make the broker say, bounded

    # -- sending ---------------------------------------------------------------------

    def _send(self, link: str, identity: bytes, msg: Message) -> bool:
        # A REQ peer's reply goes back in its envelope (an empty delimiter frame),
        # or libzmq's REQ socket drops it; a DEALER's goes without.
        payload = encode(msg)
        frames = [identity, b"", payload] if identity in self._req_peers else [identity, payload]
        try:
            self.sockets[link].send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # the peer is gone (ROUTER_MANDATORY) or its queue is full
            log.debug("send to %s %r failed: %s", link, identity, e)
            return False

    def _send_tier(self, identity: bytes, msg: Message) -> bool:
        return self._send("tier", identity, msg)

    def _publish(self, events: list[OffloadEvent]) -> None:
        """PUB drops what a slow subscriber cannot take (its high-water mark): the
        broker never waits for a router."""
        assert self.events_sock is not None
        self._event_seq += 1
        batch = EventBatch(self._event_seq, self.core.manager.step_count, events)
        try:
            self.events_sock.send(encode(batch), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("events not published: %s", e)

    # -- the loop --------------------------------------------------------------------

    def run(self) -> int:
        poller = zmq.Poller()
        for sock in self.sockets.values():
            poller.register(sock, zmq.POLLIN)
        lifeline = lifeline_fd()
        if lifeline is not None:
            poller.register(lifeline, zmq.POLLIN)
        core = self.core
        notify_ready(" ".join(f"{k}={v}" for k, v in self.addresses.items()))
        log.info("broker %s serving: %s", self.config.instance, self.addresses["client"])
        # What start-up made lives as long as the broker: out of the collector's
        # reach, a step's garbage is collected without walking it (~0.6 ms a step),
        # and so is what survives each full collection (`broker.collector`).
        core.collector.start()
        drain_deadline = 0.0
        housekeeping = Timer(min(LIVENESS_S, self.config.broker.heartbeat_s / 4))
        metrics = Timer(METRICS_S)
        while True:
            if self.stop_requested and core.state is RunState.RUNNING:
                core.begin_drain()
                drain_deadline = time.monotonic() + self.config.broker.drain_timeout_s
            if core.state is RunState.DRAINING:
                if core.drained():
                    break
                if time.monotonic() > drain_deadline:
                    log.warning("drain timeout (broker.drain_timeout_s=%.1f) passed with work "
                                "in flight", self.config.broker.drain_timeout_s)
                    break
            # Rounded up: a wait cut to 0 ms below one would spin until the tick is due,
            # taking a core from the engines on the node for nothing.
            timeout = max(0.0, min(core.tick_due(), housekeeping.left()))
            for item, _ in poller.poll(math.ceil(timeout * 1000)):
                if lifeline is not None and item == lifeline:
                    if parent_gone(lifeline):
                        log.warning("supervisor is gone: stopping")
                        self.stop_requested = True
                        poller.unregister(lifeline)
                    continue
                self._receive(item)
            # Ticks, liveness and metrics on their clocks, not after every message.
            if core.tick_due() <= 0:
                began = time.thread_time()
                core.tick()
                core.turns.record(time.monotonic(), time.thread_time() - began)
            if housekeeping.due():
                core.check_liveness()
            if self.metrics is not None and metrics.due():
                self.metrics.update(core.stats())
            core.collector.after_turn()
        core.collector.stop()
        self.close()
        return 0

    def _receive(self, sock: zmq.Socket) -> None:
        """What is queued on `sock`, up to MAX_MESSAGES_PER_WAKEUP (then the other
        sockets get their turn); the socket's EVENTS say when it is empty, so an
        empty receive never raises."""
        link = self._links[sock]
        for _ in range(MAX_MESSAGES_PER_WAKEUP):
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            if len(frames) not in (2, 3) or (len(frames) == 3 and frames[1]):
                self.core.counters["protocol_errors"] += 1
                continue
            # DEALER sends [payload]; REQ sends [b"", payload]. The router's first
            # frame is the identity either way.
            identity, payload = frames[0], frames[-1]
            if len(frames) == 3:
                self._req_peers[identity] = None
                self._req_peers.move_to_end(identity)
                while len(self._req_peers) > MAX_REQ_PEERS:
                    self._req_peers.popitem(last=False)
            self._handle(link, identity, payload)

    def _handle(self, link: str, identity: bytes, payload: bytes) -> None:
        began = time.thread_time()
        try:
            self._handle_message(link, identity, payload)
        finally:
            self.core.turns.record(time.monotonic(), time.thread_time() - began)

    def _handle_message(self, link: str, identity: bytes, payload: bytes) -> None:
        core = self.core
        allowed = {"client": CLIENT_OPS, "worker": WORKER_OPS, "tier": TIER_OPS}[link]
        try:
            msg = decode(payload, allowed)
        except ProtocolError as e:
            if link == "client":
                core.client_error(identity, peek_id(payload), e)
            else:
                core.counters["protocol_errors"] += 1
                self._warn.warning((link, identity), "dropped a malformed %s message from %s: "
                                   "%s", link, foreign(identity, 40), foreign(str(e)))
            return
        try:
            if link == "client":
                core.on_client(identity, msg)
            elif link == "worker":
                core.on_worker(identity, msg)
            else:
                core.on_tier(identity, msg)
        except Exception as e:
            # A bug must cost one message, not the node; a request still gets a reply.
            core.counters["protocol_errors"] += 1
            if self._warn.warning(("bug", link, msg.op), "error handling a %s %s message: %s",
                                  link, msg.op, foreign(repr(e))):
                log.debug("the traceback", exc_info=True)
            if link == "client":
                core.internal_error(identity, getattr(msg, "id", 0), e)

    # -- lifetime ------------------------------------------------------------------

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.core.say_goodbye()
        self._close_sockets()
        self.core.manager.shutdown()  # tiers first, then the region (closed and unlinked)
        log.info("broker %s stopped", self.config.instance)

    def _close_sockets(self) -> None:
        """Close every socket and remove the socket files this broker bound (only
        those: a file it failed to bind may be another broker's)."""
        for sock in [*self.sockets.values(), self.events_sock]:
            if sock is not None:
                sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        for address in self._bound:
            remove_ipc_file(address)
        self._bound.clear()


def main(argv: list[str] | None = None) -> int:
    started = start_process(process_parser("tierkv-broker", "the tierkv broker"), argv,
                            "broker")
    if isinstance(started, int):
        return started
    _, config = started
    try:
        proc = BrokerProc(config)
    except (RegionError, AddressError, CurveError, ConfigError, zmq.ZMQError, OSError) as e:
        log.error("cannot start: %s", e)
        return 1
    signal.signal(signal.SIGTERM, proc.request_stop)
    signal.signal(signal.SIGINT, proc.request_stop)
    return proc.run()


if __name__ == "__main__":
    sys.exit(main())
