"""How much of a lookup's round trip a faster transport than ZeroMQ could save:
`python -m tierkv.bench.transport [--rounds N] [--repeats R]`.

A 64-key lookup through the broker costs about three raw ZeroMQ round trips of the
same bytes (`tierkv bench control`), and a Unix SEQPACKET socket, which has no I/O
thread to hand each message to, echoes several times faster than ZeroMQ on the
same machine. This puts the broker's own handling of the lookup (`BrokerCore`, as
the broker runs it, in a process of its own with one blocking receive loop and no
poller) behind each transport, with the client's real encoding and reading, and
counts the CPU each side spends per round trip: the difference between the two is
all a transport change could give the control plane.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from tierkv.bench.broker_ops import KEYS_PER_REQUEST, key, timed

if TYPE_CHECKING:
    from broker.core import BrokerCore
    from tierkv.node.config import Config

KINDS = ("zmq", "unix")
MAX_MESSAGE = 1 << 20
STOP = b"stop"
SETUP = b"setup"  # the identity that stores the keys: its replies go nowhere
READY_TIMEOUT_S = 60.0


def _config(run_dir: str) -> Config:
    from tierkv.node.config import config_from_dict
    return config_from_dict({"instance": "transport", "run_dir": run_dir,
                             "cpu": {"num_blocks": 4 * KEYS_PER_REQUEST, "page_size": 1024}})


def _hot() -> list[bytes]:
    return [key(i) for i in range(KEYS_PER_REQUEST)]


def _broker_core(run_dir: str, send: Callable[[bytes, Any], object]) -> BrokerCore:
    """The broker's logic on an in-process manager (no shared memory) holding the
    lookup's 64 keys, its replies handed to `send`."""
    from broker.core import BrokerCore
    from tierkv.core.primary import PrimaryTier
    from tierkv.core.tiering import TieringManager
    from tierkv.wire.keyblob import pack_counts, pack_keys
    from tierkv.wire.protocol import KeyGroups, OpsRequest

    hot = _hot()
    manager = TieringManager(PrimaryTier(4 * KEYS_PER_REQUEST, "lru"), lease_s=1e6)

    def reply_to(link: str, identity: bytes, msg: Any) -> bool:
        if identity != SETUP:
            send(identity, msg)
        return True

    core = BrokerCore(_config(run_dir), manager, {}, reply_to)
    blob, width, lens = pack_keys(hot)
    groups = KeyGroups(pack_counts([len(hot)]), [])
    core.on_client(SETUP, OpsRequest(1, blob, width, lens, reserve=groups))
    core.on_client(SETUP, OpsRequest(2, blob, width, lens, commit=groups,
                                        commit_ok=b"\x01"))
    return core


def serve(kind: str, handle: str, address: str, run_dir: str) -> None:
    """The server process: an echo, or the broker's handling (`handle` "broker"),
    behind a ZeroMQ ROUTER or a Unix SEQPACKET socket, until its client leaves."""
    from tierkv.wire.protocol import CLIENT_OPS, decode, encode

    if kind == "unix":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(address)
        listener.listen(1)
        print("ready", flush=True)
        conn, _ = listener.accept()
        listener.close()
        message = _receiver(conn)
        receive: Callable[[], tuple[bytes, bytes]] = lambda: (b"", message())
        reply: Callable[[bytes, bytes], object] = lambda identity, data: conn.send(data)
    else:
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        print("ready", flush=True)

        def receive() -> tuple[bytes, bytes]:
            identity, data = sock.recv_multipart()
            return identity, data

        reply = lambda identity, data: sock.send_multipart([identity, data])  # noqa: E731
    core = _broker_core(run_dir, lambda identity, msg: reply(identity, encode(msg))) \
        if handle == "broker" else None
    while True:
        identity, data = receive()
        if not data or data == STOP:
            return
        if core is None:
            reply(identity, data)
        else:
            core.on_client(identity or b"lane", decode(data, CLIENT_OPS))


@contextmanager
def server(kind: str, handle: str,
           tmp: str) -> Iterator[tuple[subprocess.Popen[str], Callable[[bytes], bytes]]]:
    """A server in its own process, and a blocking round trip to it; ended by pid."""
    path = os.path.join(tmp, f"{kind}-{handle}.sock")
    address = path if kind == "unix" else f"ipc://{path}"
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.bench.transport", "--serve", kind,
                             handle, address, tmp], stdout=subprocess.PIPE, text=True)
    client_sock: socket.socket | zmq.Socket | None = None
    try:
        assert proc.stdout is not None
        if not _ready(proc):
            raise RuntimeError(f"the {kind} {handle} server did not start")
        if kind == "unix":
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            # The kernel's timeout: Python's own (`settimeout`) polls before each call.
            unix.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                            struct.pack("ll", int(READY_TIMEOUT_S), 0))
            unix.connect(address)
            client_sock = unix
            receive = _receiver(unix)

            def roundtrip(data: bytes) -> bytes:
                unix.send(data)
                return receive()
        else:
            dealer: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVTIMEO, int(READY_TIMEOUT_S * 1000))
            dealer.connect(address)
            client_sock = dealer

            def roundtrip(data: bytes) -> bytes:
                dealer.send(data)
                return dealer.recv()
        yield proc, roundtrip
        if kind == "zmq":
            client_sock.send(STOP)
    finally:
        if client_sock is not None:
            client_sock.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        Path(path).unlink(missing_ok=True)  # the next repeat binds it again


def _receiver(sock: socket.socket) -> Callable[[], bytes]:
    """One whole message at a time, into a buffer made once: `recv` of the largest
    size would map and unmap a fresh megabyte for every message."""
    buffer = bytearray(MAX_MESSAGE)
    view = memoryview(buffer)

    def receive() -> bytes:
        return bytes(view[:sock.recv_into(buffer)])
    return receive


def _ready(proc: subprocess.Popen[str]) -> bool:
    assert proc.stdout is not None
    return proc.stdout.readline().startswith("ready")


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kind: str, handle: str, rounds: int, tmp: str) -> dict[str, float]:
    """Median round trip (seconds) and, per round trip, the caller's thread CPU and
    the server's process CPU."""
    from tierkv.client import Client
    from tierkv.wire.protocol import Reply, decode, encode

    client = Client.from_config(_config(tmp))  # builds requests and reads replies only
    hot = _hot()
    ids = iter(range(1, 1 << 62))
    payload = encode(client.batch().lookup(hot, "bench").request(1))
    with server(kind, handle, tmp) as (proc, roundtrip):
        if handle == "broker":
            def once() -> None:
                batch = client.batch().lookup(hot, "bench")
                reply = decode(roundtrip(encode(batch.request(next(ids)))))
                assert isinstance(reply, Reply)
                (found,) = batch.read(reply)
                if found.hits != len(hot):
                    raise RuntimeError(f"the lookup found {found.hits} of {len(hot)} keys")
        else:
            def once() -> None:
                roundtrip(payload)
        timed(once, 200)  # connected and warm
        server_before, thread_before = _cpu_s(proc.pid), time.thread_time()
        samples = timed(once, rounds)
        server_cpu, thread_cpu = _cpu_s(proc.pid) - server_before, \
            time.thread_time() - thread_before
    client.close()
    return {"median": statistics.median(samples), "client_cpu": thread_cpu / rounds,
            "server_cpu": server_cpu / rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.transport",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4000, help="round trips per measurement")
    parser.add_argument("--repeats", type=int, default=3,
                        help="each measurement this many times in turn (medians reported)")
    parser.add_argument("--serve", nargs=4, metavar=("KIND", "HANDLE", "ADDRESS", "RUN_DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return 0
    cases = [(kind, handle) for handle in ("echo", "broker") for kind in KINDS]
    runs: dict[tuple[str, str], list[dict[str, float]]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for case in cases:
                runs[case].append(measure(*case, args.rounds, tmp))
    got = {case: {name: statistics.median(r[name] for r in rs) for name in rs[0]}
           for case, rs in runs.items()}
    us = 1e6
    print(f"round trips of a {KEYS_PER_REQUEST}-key lookup, medians of {args.repeats} "
          f"repeats of {args.rounds}:")
    for handle, what in (("echo", "echo of its bytes"), ("broker", "the broker's handling")):
        for kind in KINDS:
            g = got[kind, handle]
            print(f"  {what:22s} {kind:4s} {g['median'] * us:7.1f} us   CPU per round trip: "
                  f"caller's thread {g['client_cpu'] * us:6.1f} us, server "
                  f"{g['server_cpu'] * us:6.1f} us")
    echo = got["unix", "echo"]["median"] / got["zmq", "echo"]["median"]
    zmq_lookup, unix_lookup = got["zmq", "broker"]["median"], got["unix", "broker"]["median"]
    print(f"time of a round trip over the Unix socket / over ZeroMQ: echo {echo:.2f}, "
          f"lookup {unix_lookup / zmq_lookup:.2f} "
          f"({(zmq_lookup - unix_lookup) * us:.1f} us saved of {zmq_lookup * us:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
