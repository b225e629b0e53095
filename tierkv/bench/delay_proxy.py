"""A slow link on loopback: a TCP proxy that delays every request by a fixed time.

A tier behind a WAN link (S3 in another region, a busy gateway) answers each
request a fixed time late, however small the request. `DelayProxy` puts such a link
in front of a local endpoint, for benchmarks and tests of what a node does with a
tier that is slower than recomputing:

    with DelayProxy("http://127.0.0.1:9000", delay_s=1.5) as proxy:
        tier = {"type": "s3", "endpoint_url": proxy.endpoint_url, ...}

Each byte the client sends is forwarded `delay_s` after it arrived (a delay line,
order kept): a request, however many reads it takes, arrives `delay_s` late, and
requests in a row on one connection are each delayed once, not once per chunk.
Answers go back as they come (`answer_delay_s` delays them too). The delay can be
changed while the proxy runs (`delay_s` is read for each chunk), so one proxy
serves several link speeds in turn.

In a thread of the caller (`start`/`stop`, or `with`), or as a process of its own:

    python -m tierkv.bench.delay_proxy --target http://127.0.0.1:9000 --delay-s 1.5

which prints `port N` once it listens and runs until SIGTERM or SIGINT. Only
loopback addresses, for the proxy and its target.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

LOOPBACK = ("127.0.0.1", "::1", "localhost")
CHUNK = 262_144
QUEUE_CHUNKS = 64  # chunks held per direction of a connection: a slow reader backs up
CONNECT_TIMEOUT_S = 5.0  # to the target, a local endpoint: it answers at once or is down
JOIN_TIMEOUT_S = 5.0  # a pump thread ends once its sockets are shut


def loopback_target(url: str) -> tuple[str, int]:
    """(host, port) of `url`, which must name a loopback host and a port."""
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    if parts.hostname not in LOOPBACK or parts.port is None:
        raise ValueError(f"the delay proxy's target must be a loopback host:port, got {url!r}")
    return parts.hostname, parts.port


class DelayProxy:
    """Listens on 127.0.0.1 (a free port, or `port`), forwards each connection to
    `target` (a loopback URL or host:port). Every wait has a timeout; `stop` cuts
    every connection and joins the threads."""

    def __init__(self, target: str, delay_s: float, answer_delay_s: float = 0.0,
                 port: int = 0) -> None:
        if delay_s < 0 or answer_delay_s < 0:
            raise ValueError(f"delays must be >= 0, got {delay_s} and {answer_delay_s}")
        self.target = loopback_target(target)
        self.delay_s = delay_s
        self.answer_delay_s = answer_delay_s
        self.port = port
        self.connections = 0  # accepted so far
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DelayProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._spawn(self._accept, listener)
        return self

    def stop(self) -> None:
        """Close the port and every connection through it; join the threads."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
            threads, self._threads = self._threads, []
        for s in sockets:
            _shut(s)
        for t in threads:
            t.join(JOIN_TIMEOUT_S)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- connections ---------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="delay-proxy")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by stop
            self.connections += 1
            self._spawn(self._connect, client)

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            client.close()  # the client sees its connection cut, as with a dead endpoint
            return
        upstream.settimeout(None)
        with self._lock:
            if self._listener is None:  # stopped meanwhile
                _shut(client)
                _shut(upstream)
                return
            self._sockets.update((client, upstream))
        self._spawn(self._delay_line, client, upstream, lambda: self.delay_s)
        self._spawn(self._delay_line, upstream, client, lambda: self.answer_delay_s)

    def _delay_line(self, src: socket.socket, dst: socket.socket,
                    delay: Callable[[], float]) -> None:
        """Read `src`, write each chunk to `dst` `delay()` after it arrived. A
        reader thread of its own keeps reading while a chunk waits its turn, so a
        request's later chunks are not delayed again."""
        held: queue.Queue[tuple[float, bytes] | None] = queue.Queue(QUEUE_CHUNKS)
        reader = threading.Thread(target=_read_into, args=(src, held), daemon=True,
                                  name="delay-proxy-read")
        reader.start()
        try:
            while (item := held.get()) is not None:
                arrived, data = item
                wait = arrived + delay() - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(src)
            _shut(dst)
            # The reader ends once src is shut; drain so it is never stuck on a full queue.
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while reader.is_alive() and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    held.get(timeout=0.1)
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)
            src.close()


def _read_into(src: socket.socket, held: queue.Queue[tuple[float, bytes] | None]) -> None:
    """Each chunk of `src` with the time it arrived; None at its end."""
    try:
        while data := src.recv(CHUNK):
            held.put((time.monotonic(), data))
    except OSError:
        pass
    held.put(None)


def _shut(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)


# -- as a process of its own ---------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.delay_proxy",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="loopback URL or host:port")
    parser.add_argument("--delay-s", type=float, required=True,
                        help="added to each request (client to target)")
    parser.add_argument("--answer-delay-s", type=float, default=0.0,
                        help="added to each answer (target to client)")
    parser.add_argument("--port", type=int, default=0, help="to listen on (0: a free one)")
    args = parser.parse_args(argv)
    try:
        proxy = DelayProxy(args.target, args.delay_s, args.answer_delay_s, args.port)
    except ValueError as e:
        parser.error(str(e))
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())  # the handler only flips state
    with proxy:
        print(f"port {proxy.port}", flush=True)
        while not stopped.wait(1.0):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
