"""The S3 tier in the conformance suite, against a real HTTP endpoint: a local moto
server started once per test module on a free loopback port, polled until it
answers, stopped by pid at teardown.

Fixture functions are named `fixture_*`/`make_*` so tests/tiers/conftest.py picks
them up; other test packages import them directly (`from tests.tiers.fixtures_s3
import ...`). Credentials are dummies in the environment: no test may reach AWS.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tierkv.core.blockformat import HEADER_SIZE
from tierkv.node.s3server import S3Server

# Dummy credentials, and no instance-metadata lookups: nothing may leave loopback.
TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "tierkv-test-key",
    "AWS_SECRET_ACCESS_KEY": "tierkv-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@contextlib.contextmanager
def s3_test_env() -> Iterator[None]:
    """Set TEST_ENV for the duration."""
    saved = {k: os.environ.get(k) for k in TEST_ENV}
    os.environ.update(TEST_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def unique_bucket(tag: str = "t") -> str:
    return f"tierkv-{tag}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module", name="s3_server")
def fixture_s3_server() -> Iterator[S3Server]:
    """One moto server per test module (starting one costs about a second)."""
    with s3_test_env(), S3Server(ready_timeout_s=30) as server:
        yield server


@pytest.fixture(name="s3_entry")
def fixture_s3_entry(s3_server: S3Server) -> dict[str, Any]:
    """A tier entry on a fresh bucket of the module's server (fast-failing settings)."""
    return {
        "type": "s3", "bucket": unique_bucket(), "endpoint_url": s3_server.endpoint_url,
        "create_bucket": True, "max_attempts": 2, "connect_timeout_s": 1.0,
        "read_timeout_s": 5.0, "exists_timeout_s": 1.0, "max_concurrency": 8,
    }


@pytest.fixture(name="make_s3")
def fixture_make_s3(s3_entry: dict[str, Any]) -> Iterator[Callable[..., Any]]:
    from workers.s3 import S3Backend

    made: list[S3Backend] = []

    def make(block_bytes: int, capacity_blocks: int = 64, **options: Any) -> S3Backend:
        spec = {k: v for k, v in s3_entry.items() if k != "type"}
        spec.update(budget_bytes=capacity_blocks * (HEADER_SIZE + block_bytes),
                    namespace=f"ns-{uuid.uuid4().hex[:8]}")
        spec.update(options)
        backend = S3Backend(block_bytes=block_bytes, **spec)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


class FlakyEndpoint:
    """A TCP forwarder on loopback in front of an S3 endpoint, to inject faults for
    real: `down()` closes the port (connections are refused), `up()` opens it
    again on the same port, `drop_next(n)` closes the next n connections without
    an answer, `throttle_next(n)` answers them `503 SlowDown`, `stall(True)` holds
    new connections open and never answers (a hung endpoint), `delay_s` sends each
    chunk of every answer that much late (slow I/O)."""

    def __init__(self, target_url: str) -> None:
        from urllib.parse import urlsplit

        target = urlsplit(target_url)
        self.target = (target.hostname or "127.0.0.1", target.port or 80)
        self.port = 0
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._drop = 0
        self._throttle = 0
        self._stall = False
        self._stalled: list[socket.socket] = []
        self.accepted = 0
        self.delay_s = 0.0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> FlakyEndpoint:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def down(self) -> None:
        """Refuse new connections and cut the open ones."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def drop_next(self, n: int) -> None:
        with self._lock:
            self._drop = n

    def stall(self, on: bool) -> None:
        with self._lock:
            self._stall = on
            stalled, self._stalled = (self._stalled, []) if not on else ([], self._stalled)
        for conn in stalled:
            conn.close()

    def throttle_next(self, n: int) -> None:
        with self._lock:
            self._throttle = n

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                drop, self._drop = self._drop > 0, max(0, self._drop - 1)
                throttle = not drop and self._throttle > 0
                self._throttle = max(0, self._throttle - (1 if throttle else 0))
                if self._stall:
                    self._stalled.append(client)
                    continue
            if drop:
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client, throttle), daemon=True).start()

    def _serve(self, client: socket.socket, throttle: bool) -> None:
        if throttle:
            self._slow_down(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._conns.update((client, upstream))
        threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()
        self._pump(client, upstream)

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool = False) -> None:
        try:
            while data := src.recv(65536 if answers else 262144):
                if answers and self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._conns.discard(src)
            self._conns.discard(dst)
        src.close()

    @staticmethod
    def _slow_down(client: socket.socket) -> None:
        body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                b"<Message>Please reduce your request rate.</Message></Error>")
        with contextlib.suppress(OSError):
            client.settimeout(2)
            client.recv(65536)  # the request head (a PUT waits for 100-continue)
            client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                           b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                           % (len(body), body))
        client.close()

    def close(self) -> None:
        self.stall(False)
        self.down()
