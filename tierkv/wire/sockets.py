"""The one place that makes ZeroMQ sockets and sets their options.

Every socket gets: no linger (a dead peer never blocks a close), bounded queues,
the protocol's maximum message size (a larger frame is dropped by libzmq before it
costs memory), and ROUTER_MANDATORY on routers (sending to a vanished peer is an
error we count, not a silent drop). ipc socket files live in an owner-only run
directory and are owner-only themselves. A tcp address beyond loopback is refused
unless CurveZMQ keys are configured.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq

from tierkv.wire.codec import MAX_MESSAGE_BYTES

log = logging.getLogger("tierkv.wire.sockets")

HWM = 100_000


class AddressError(ValueError):
    """An address that is malformed or not allowed."""


def make_socket(
    ctx: zmq.Context, kind: int, identity: bytes | None = None
) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def ensure_run_dir(path: str | os.PathLike[str]) -> Path:
    """Create the run directory owner-only (0700); refuse one others can enter."""
    run_dir = Path(path)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = run_dir.stat()
    if st.st_uid != os.getuid():
        raise AddressError(f"run directory {run_dir} belongs to another user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(run_dir, 0o700)
    return run_dir


def ipc_path(address: str) -> Path | None:
    return Path(address[len("ipc://") :]) if address.startswith("ipc://") else None


def is_loopback(address: str) -> bool:
    if not address.startswith("tcp://"):
        return True  # ipc and inproc never leave the machine
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or interface name: treat as reachable from outside


def check_address(address: str, curve: bool = False) -> None:
    if not address.startswith(("ipc://", "tcp://", "inproc://")):
        raise AddressError(f"address {address!r} must start with ipc://, tcp:// or inproc://")
    if not is_loopback(address) and not curve:
        raise AddressError(
            f"address {address} is reachable beyond loopback: configure CurveZMQ keys "
            "(broker.curve_server_secret_file) or bind to 127.0.0.1/::1/ipc"
        )


def bind(sock: zmq.Socket, address: str, curve: bool = False) -> None:
    check_address(address, curve)
    path = ipc_path(address)
    if path is not None:
        ensure_run_dir(path.parent)
        if path.exists():
            path.unlink()  # a previous run's file; the instance lock is the shm region
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(address)
    if path is not None:
        os.chmod(path, 0o600)


def connect(sock: zmq.Socket, address: str) -> None:
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(address)


def remove_ipc_file(address: str) -> None:
    path = ipc_path(address)
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


# -- CurveZMQ -----------------------------------------------------------------------
#
# Keys live in files made by `tierkv keygen` (zmq's certificate format): a name.key
# (public) and a name.key_secret (both keys, owner-only). The broker needs its
# secret file and a directory of the public keys it lets in; every peer (client,
# worker, tier) needs its own secret file and the broker's public key. Only paths
# are ever logged.


class CurveError(ValueError):
    """A key file that is missing, unreadable or not a CurveZMQ certificate."""


@dataclass(frozen=True)
class CurveClientKeys:
    secret_file: str
    server_public_file: str


def _load(path: str, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not path or not os.path.isfile(path):
        raise CurveError(f"CurveZMQ key file {path!r} does not exist")
    if secret and stat.S_IMODE(os.stat(path).st_mode) & 0o077:
        raise CurveError(f"CurveZMQ secret key file {path} is readable by others: chmod 600 it")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise CurveError(f"{path} is not a CurveZMQ certificate ({type(e).__name__})") from None
    if secret and not secret_key:
        raise CurveError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret_key


def curve_server(sock: zmq.Socket, secret_file: str) -> None:
    public, secret = _load(secret_file, secret=True)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)  # type: ignore[arg-type]


def curve_client(sock: zmq.Socket, keys: CurveClientKeys) -> None:
    public, secret = _load(keys.secret_file, secret=True)
    server_public, _ = _load(keys.server_public_file, secret=False)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)  # type: ignore[arg-type]


def start_authenticator(ctx: zmq.Context, authorized_dir: str):  # noqa: ANN201
    """Let in only clients whose public key is in `authorized_dir` (ZAP)."""
    from zmq.auth.thread import ThreadAuthenticator

    if not authorized_dir or not os.path.isdir(authorized_dir):
        raise CurveError(
            f"broker.curve_authorized_dir {authorized_dir!r} is not a directory of public keys"
        )
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("tierkv.zap"))
    auth.start()
    auth.configure_curve(domain="*", location=authorized_dir)
    log.info("CurveZMQ on: clients must hold a key listed in %s", authorized_dir)
    return auth


def create_keys(directory: str, name: str) -> tuple[str, str]:
    """A new key pair in `directory`: (public file, secret file, mode 0600)."""
    import zmq.auth

    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret
