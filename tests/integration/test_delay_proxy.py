"""The slow link of the engine benchmarks (`tierkv.bench.delay_proxy`): a request
through it arrives late by the delay, once per request however many reads it takes,
whole and in order; it runs in a thread or as a process of its own, and stops."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tierkv.bench.delay_proxy import DelayProxy

DELAY_S = 0.5
BIG = 4 << 20  # 16 reads of the proxy's chunk at least
WAIT_S = 30.0


class LengthEcho:
    """A loopback server: per connection, reads requests of `8-byte length + body`
    and answers each with the body's length and the time it had it all."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.threads: list[threading.Thread] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self.threads.append(accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(WAIT_S)
        with conn, contextlib.suppress(OSError):
            while head := _read_exactly(conn, 8):
                body = _read_exactly(conn, int.from_bytes(head, "big"))
                conn.sendall(len(body).to_bytes(8, "big") + repr(time.monotonic()).encode()
                             .ljust(32))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        for t in self.threads:
            t.join(5)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = conn.recv(min(n - len(out), 1 << 20))
        if not data:
            return bytes(out)
        out += data
    return bytes(out)


def ask(conn: socket.socket, body: bytes) -> tuple[int, float, float]:
    """(bytes the server got, when it had them, when the request was sent)."""
    sent = time.monotonic()
    conn.sendall(len(body).to_bytes(8, "big") + body)
    answer = _read_exactly(conn, 40)
    return int.from_bytes(answer[:8], "big"), float(answer[8:].decode()), sent


@pytest.fixture
def server() -> Iterator[LengthEcho]:
    s = LengthEcho()
    yield s
    s.close()


def test_each_request_arrives_late_by_the_delay_once_and_whole(server):
    with DelayProxy(f"127.0.0.1:{server.port}", DELAY_S) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT_S) as conn:
        took = []
        for body in (b"x", os.urandom(BIG), b"y" * 100):  # three requests on one connection
            got, arrived, sent = ask(conn, body)
            assert got == len(body)
            took.append(arrived - sent)
        print(f"through a {DELAY_S}s link: " + ", ".join(f"{t:.3f}s" for t in took))
        assert all(t >= DELAY_S for t in took)
        # Delayed once per request: a delay per read would add 16 x DELAY_S to the big one.
        assert took[1] < 6 * DELAY_S
        assert proxy.connections == 1


def test_the_delay_can_change_while_it_runs(server):
    with DelayProxy(f"127.0.0.1:{server.port}", 0.0) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT_S) as conn:
        ask(conn, b"fast")
        proxy.delay_s = DELAY_S
        _, arrived, sent = ask(conn, b"slow")
        assert arrived - sent >= DELAY_S


def test_stop_cuts_open_connections(server):
    proxy = DelayProxy(f"127.0.0.1:{server.port}", 0.0).start()
    conn = socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT_S)
    ask(conn, b"one")
    proxy.stop()
    with conn:
        assert conn.recv(1) == b""  # closed by the proxy
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2).close()


def test_only_loopback_targets():
    with pytest.raises(ValueError, match="loopback host:port"):
        DelayProxy("http://192.0.2.1:80", 1.0)
    with pytest.raises(ValueError, match="loopback host:port"):
        DelayProxy("http://127.0.0.1", 1.0)  # no port
    with pytest.raises(ValueError, match="delays must be >= 0"):
        DelayProxy("127.0.0.1:9", -1.0)


def test_as_a_process_it_says_its_port_and_ends_on_sigterm(server):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierkv.bench.delay_proxy", "--target",
         f"http://127.0.0.1:{server.port}", "--delay-s", str(DELAY_S)],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
        assert ready, f"no port line within {WAIT_S:.0f}s"
        line = proc.stdout.readline().split()
        assert line[0] == "port"
        with socket.create_connection(("127.0.0.1", int(line[1])), timeout=WAIT_S) as conn:
            got, arrived, sent = ask(conn, b"through the process")
        assert got == len(b"through the process") and arrived - sent >= DELAY_S
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(WAIT_S)
        if proc.stdout is not None:
            proc.stdout.close()
