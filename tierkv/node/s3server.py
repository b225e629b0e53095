"""A local S3 endpoint (moto) as a child process, on loopback only: for demos and
tests. Production runs against a real S3 (AWS, MinIO, Ceph RGW).

The embedded default of the demo and every S3 test talk HTTP to a real endpoint:
a `moto` server in its own process. It admits only requests signed with the one
key pair it was given (`tierkv.node.s3auth`): other users on the host, and any
process without the secret, can neither list, read nor write its buckets.

`S3Server` starts it with the supervisor's ready pipe and lifeline
(`tierkv.node.lifecycle`): the child binds port 0 itself and reports the port it
got, so there is no race for a "free" port, and it stops by itself if its parent
dies, so a crashed test leaves no server behind. The parent then polls the HTTP
endpoint until it answers, and stops the child by pid (SIGTERM, then SIGKILL).

    with S3Server() as server:   # the key pair: AWS_ACCESS_KEY_ID/..._SECRET_... or new
        client = boto3.client("s3", endpoint_url=server.endpoint_url, **server.boto_keys)

The key pair reaches the child over its secret pipe (`tierkv.node.lifecycle`), never
its command line or environment. The child side by hand is `python -m
tierkv.node.s3server [--host 127.0.0.1] [--port 0]`, with the key pair in the
environment variables `--access-key-id-env` and `--secret-access-key-env` name.
Only loopback addresses are accepted. Importing this module costs nothing; moto is
imported in the child only.
"""

from __future__ import annotations

import argparse
import http.client
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping

from tierkv.node.lifecycle import (
    Child,
    ChildFailed,
    child_environment,
    lifeline_fd,
    notify_ready,
    parent_gone,
    spawn,
    stop,
    take_secrets,
    wait_ready,
)
from tierkv.node.s3auth import KeyPair

log = logging.getLogger("tierkv.s3")

LOOPBACK = ("127.0.0.1", "::1")
KEY_ID_SECRET, KEY_SECRET_SECRET = "s3_access_key_id", "s3_secret_access_key"  # secret pipe
ENV_KEY_ID, ENV_SECRET = "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"


class S3ServerError(RuntimeError):
    """The local S3 endpoint did not start or did not answer in time."""


def check_loopback(host: str) -> str:
    if host not in LOOPBACK:
        raise ValueError(
            f"the local S3 endpoint binds loopback only ({' or '.join(LOOPBACK)}), not {host!r}"
        )
    return host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def server_argv(python: str = sys.executable, host: str = "127.0.0.1",
                port: int = 0) -> list[str]:
    """The command line of the endpoint process, for a supervisor that spawns it
    itself (`tierkv.node.lifecycle.spawn`); its ready line names the port it bound."""
    return [python, "-m", "tierkv.node.s3server", "--host", check_loopback(host),
            "--port", str(port)]


def port_from_ready(detail: str) -> int:
    """The port from the child's ready line ("s3 endpoint port 41234")."""
    return int(detail.split()[-1])


def new_keys() -> KeyPair:
    """A fresh random key pair, for an endpoint whose clients are told it."""
    return KeyPair("tierkv-" + secrets.token_hex(8), secrets.token_urlsafe(30))


def keys_from_env(env: Mapping[str, str] = os.environ, key_id: str = ENV_KEY_ID,
                  secret: str = ENV_SECRET) -> KeyPair | None:
    """The key pair in these environment variables, None when either is unset."""
    if env.get(key_id) and env.get(secret):
        return KeyPair(env[key_id], env[secret])
    return None


class S3Server:
    """A moto S3 server process owned by this object (and context manager)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        ready_timeout_s: float = 30.0,
        stop_timeout_s: float = 5.0,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        name: str = "s3server",
        sink: Callable[[str], None] | None = None,
        keys: KeyPair | None = None,
    ) -> None:
        """`sink` receives each line the endpoint logs (a node's log file). `keys`:
        the only key pair the endpoint admits; by default the one in this process's
        AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (so that clients reading those
        find it), else a new random one (see `boto_keys`)."""
        self.host = check_loopback(host)
        self.keys = keys or keys_from_env() or new_keys()
        self.requested_port = port
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.python = python
        self.extra_env = dict(env or {})
        self.name = name
        self.sink = sink
        self.port: int | None = None
        self.child: Child | None = None

    # -- lifetime ----------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise S3ServerError("the local S3 endpoint is not started")
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def boto_keys(self) -> dict[str, str]:
        """The key pair as boto3.client / Session keyword arguments."""
        return {"aws_access_key_id": self.keys.access_key_id,
                "aws_secret_access_key": self.keys.secret_access_key}

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None else None

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.proc.poll() is None

    def start(self) -> S3Server:
        if self.child is not None:
            return self
        argv = server_argv(self.python, self.host, self.requested_port)
        env = child_environment(self.extra_env)
        deadline = time.monotonic() + self.ready_timeout_s
        self.child = spawn(self.name, argv, env=env, sink=self.sink,
                           secrets={KEY_ID_SECRET: self.keys.access_key_id,
                                    KEY_SECRET_SECRET: self.keys.secret_access_key})
        try:
            wait_ready([self.child], self.ready_timeout_s)
            self.port = port_from_ready(self.child.ready_detail)
            self._poll_http(deadline)
        except (ChildFailed, ValueError, IndexError) as e:
            self.stop()
            raise S3ServerError(f"the local S3 endpoint did not start: {e}") from e
        except BaseException:
            self.stop()
            raise
        log.info("local S3 endpoint %s serving (pid %d)", self.endpoint_url, self.child.pid)
        return self

    def _poll_http(self, deadline: float) -> None:
        """Ready means it answers HTTP, not just that the socket is bound (an
        unsigned request is refused: an answer all the same)."""
        assert self.port is not None
        last = ""
        while time.monotonic() < deadline:
            if not self.running:
                raise S3ServerError(f"the local S3 endpoint exited: {self._tail()}")
            conn = http.client.HTTPConnection(self.host, self.port, timeout=1.0)
            try:
                conn.request("GET", "/")
                conn.getresponse().read()
                return
            except OSError as e:
                last = str(e)
            finally:
                conn.close()
            time.sleep(0.05)
        raise S3ServerError(
            f"the local S3 endpoint {self.endpoint_url} did not answer within "
            f"{self.ready_timeout_s:.0f}s (ready_timeout_s): {last}"
        )

    def stop(self) -> int | None:
        """Terminate by pid, then kill after `stop_timeout_s`. Idempotent."""
        child, self.child = self.child, None
        if child is None:
            return None
        return stop(child, self.stop_timeout_s)

    def kill(self) -> None:
        """SIGKILL, for fault-injection tests (the endpoint vanishes mid-run)."""
        if self.child is not None and self.child.proc.poll() is None:
            self.child.proc.kill()
            self.child.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the endpoint accepts connections but never answers."""
        if self.running:
            assert self.child is not None
            os.kill(self.child.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.child is not None and self.child.proc.poll() is None:
            os.kill(self.child.pid, signal.SIGCONT)

    def _tail(self) -> str:
        return self.child.tail(10) if self.child is not None else ""

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.endpoint_url if self.port is not None else "not started"
        return f"S3Server({where}, pid={self.pid})"


# -- child side ------------------------------------------------------------------------


def _watch_lifeline(stopped: threading.Event) -> None:
    """Stop when the parent dies (its end of the lifeline closes)."""
    fd = lifeline_fd()
    if fd is None:
        return

    def watch() -> None:
        import select

        while not stopped.is_set():
            readable, _, _ = select.select([fd], [], [], 0.5)
            if readable and parent_gone(fd):
                stopped.set()
                return

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def serve(host: str, port: int, keys: KeyPair) -> int:
    """Run a moto S3 server that admits only requests signed with `keys` until
    SIGTERM/SIGINT or the parent's death."""
    check_loopback(host)
    # A request log line per block would swamp the supervisor's log buffer.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    from tierkv.node.s3auth import SignedOnly

    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    # moto's ThreadedMotoServer, with every request checked before moto sees it.
    app = SignedOnly(DomainDispatcherApplication(create_backend_app), keys)
    server = make_server(host, port, app, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, name="s3-endpoint", daemon=True).start()
    bound = server.server_address[1]
    _watch_lifeline(stopped)
    notify_ready(f"s3 endpoint port {bound}")
    log.info("local S3 endpoint on http://%s:%d", _url_host(host), bound)
    while not stopped.wait(0.1):
        pass
    # Not server.stop(): a request handler blocked on a dead client could hold the
    # shutdown; the process is ending anyway.
    log.info("local S3 endpoint on http://%s:%d stopped", _url_host(host), bound)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.node.s3server",
                                     description="a local S3 endpoint (moto) on loopback")
    parser.add_argument("--host", default="127.0.0.1", choices=LOOPBACK)
    parser.add_argument("--port", type=int, default=0, help="0: any free port (reported)")
    parser.add_argument("--access-key-id-env", default=ENV_KEY_ID, metavar="NAME",
                        help=f"the variable holding the access key id (default {ENV_KEY_ID})")
    parser.add_argument("--secret-access-key-env", default=ENV_SECRET, metavar="NAME",
                        help=f"the variable holding the secret key (default {ENV_SECRET})")
    args = parser.parse_args(argv)
    from tierkv.node.logs import setup_logging

    setup_logging("s3server")
    given = take_secrets()  # from a parent (S3Server): never the environment
    try:
        if KEY_ID_SECRET in given:
            keys: KeyPair | None = KeyPair(given[KEY_ID_SECRET], given.get(KEY_SECRET_SECRET, ""))
        else:
            keys = keys_from_env(os.environ, args.access_key_id_env, args.secret_access_key_env)
    except ValueError as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 2
    if keys is None:
        print(f"{parser.prog}: set {args.access_key_id_env} and {args.secret_access_key_env}: "
              f"the endpoint admits only requests signed with that key pair", file=sys.stderr)
        return 2
    return serve(args.host, args.port, keys)


if __name__ == "__main__":
    sys.exit(main())
