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


class RunDirError(AddressError):
    """A run directory that is not this user's alone; the message names the path."""


def ensure_run_dir(path: str | os.PathLike[str]) -> Path:
    """Create the run directory owner-only (0700), with every folder tierkv makes
    for it, and check the ones that exist: each must be a directory of this user
    that no one else can enter. Otherwise refuse (RunDirError), changing nothing:
    a folder another user made first (the default lives under the shared temp
    directory) would let them read or replace the node's sockets."""
    run_dir = Path(path)
    chain = _own_chain(run_dir)
    if not chain[0].parent.is_dir():
        chain[0].parent.mkdir(parents=True, exist_ok=True)  # e.g. a configured run_dir's home
    for folder in chain:
        try:
            os.mkdir(folder, 0o700)  # the umask can only take bits away
        except FileExistsError:
            pass
        _check_own_dir(folder)
    return run_dir


def check_run_dir(path: str | os.PathLike[str]) -> bool:
    """`ensure_run_dir`'s checks, making nothing: False when the run directory does
    not exist; RunDirError when it, or a folder above it tierkv makes, is not this
    user's alone (nothing in it is to be trusted then)."""
    for folder in _own_chain(Path(path)):
        if not os.path.lexists(folder):
            return False
        _check_own_dir(folder)
    return True


def _own_chain(run_dir: Path) -> list[Path]:
    """The folders from `_owned_top(run_dir)` down to `run_dir`, top first."""
    top = _owned_top(run_dir)
    chain = [run_dir, *run_dir.parents]
    return list(reversed(chain[: chain.index(top) + 1]))


def _owned_top(run_dir: Path) -> Path:
    """The topmost folder of `run_dir` that must be this user's alone: for the
    default run directories (`tierkv.node.config.Config.run_path`) the per-user
    folder tierkv makes, for any other the run directory itself."""
    bases = [Path(f"/tmp/tierkv-{os.getuid()}")]
    if os.environ.get("XDG_RUNTIME_DIR"):
        bases.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "tierkv")
    for base in bases:
        if run_dir == base or base in run_dir.parents:
            return base
    return run_dir


def _check_own_dir(folder: Path) -> None:
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise RunDirError(f"run directory {folder} is a symbolic link: it must be a directory "
                          f"of your own (remove it, or set run_dir)")
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(f"run directory {folder} is not a directory")
    if st.st_uid != os.getuid():
        raise RunDirError(f"run directory {folder} belongs to uid {st.st_uid}, not to you "
                          f"(uid {os.getuid()}): another user may have made it to read or "
                          f"replace this node's sockets; remove it, or set run_dir")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise RunDirError(f"run directory {folder} has mode {mode:04o}: others can enter it; "
                          f"it must be 0700 (chmod 700 {folder})")


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
            "(broker.curve_secret_file and broker.curve_authorized_dir) or bind to "
            "127.0.0.1/::1/ipc"
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
