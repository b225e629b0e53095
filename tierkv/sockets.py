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
import os
import stat
from pathlib import Path

import zmq

from tierkv.protocol import MAX_MESSAGE_BYTES

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
