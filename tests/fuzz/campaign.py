"""A campaign of hostile input against a running node (issue 20), with health checks.

Every class of input the first campaign found something with, on all three sockets:
random bytes, truncated and oversized msgpack, wrong types, deep nesting, huge
arrays, out-of-range ids, unknown ops, hostile registrations (client); mangled
hellos, forged heartbeats, completions and attach replies (worker); mangled hellos
naming other processes, forged credit, completions, inventories and stats (tier).
Every `check_every` inputs the node must still be the same broker (pid unchanged),
answer a stats probe within `PROBE_S`, and carry a legitimate store and load
byte-exact; the broker's RSS, open fds and log bytes are recorded before and after.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import zmq

from tests.integration.cluster import Cluster, keys
from tierkv.client import BrokerUnavailable, Client, RemoteError
from tierkv.wire.protocol import PROTOCOL_VERSION

V = PROTOCOL_VERSION
NO_PROCESS = 1 << 23  # above Linux's highest pid_max: never a process
PROBE_S = 5.0  # a legitimate stats call slower than this counts as a hang
ROTATE_EVERY = 400  # inputs sent from one identity before a new one


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def deep(depth: int, leaf: bytes = b"\x01") -> bytes:
    """A map nested `depth` deep, built by hand (msgpack's packer stops at 512)."""
    return b"\x81\xa1x" * depth + leaf


def huge_array(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + b"\xc0" * n


def junk(rng: random.Random) -> object:
    return rng.choice([None, True, -1, 2**63 - 1, -(2**63), 1.5, "", "x" * rng.randrange(50),
                       b"\xff" * rng.randrange(80), [], [1, "a"], {"a": 1}, {1: 2}])


def mutate(payload: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0 and len(payload) > 1:
        return payload[: rng.randrange(1, len(payload))]  # truncated
    b = bytearray(payload)
    if kind == 1:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)  # bit flips
        return bytes(b)
    if kind == 2:
        return payload + payload[: rng.randrange(len(payload) + 1)]  # trailing bytes
    return os.urandom(rng.randrange(1, 200))  # random bytes


def groups(counts: list[int], rng: random.Random) -> dict:
    g: dict = {"counts": b"".join(c.to_bytes(4, "little", signed=True) for c in counts)}
    if rng.random() < 0.5:
        g["req_ids"] = [rng.choice(["r", "", "x" * 300]) for _ in counts]
    return g


def client_input(rng: random.Random) -> bytes:
    i = rng.randrange(2**31)
    w = 16
    k = os.urandom(w)

    def ops(**fields: object) -> dict:
        return {"v": V, "op": "ops", "id": i, **fields}

    choices: list[Callable[[], object]] = [
        lambda: os.urandom(rng.randrange(1, 300)),
        lambda: {"v": V, "op": rng.choice(["nuke", "", "reply", "tier_hello", "transfer",
                                           "lookup", "batch"]), "id": i},
        lambda: {"v": junk(rng), "op": "stats", "id": i},
        lambda: {"v": "x" * rng.randrange(10_000, 2_000_000), "op": "stats", "id": i},
        lambda: ops(keys=junk(rng), key_len=junk(rng), lookup=junk(rng)),
        lambda: ops(keys=k * 3, key_len=w, lookup=groups([rng.randrange(-3, 6)], rng)),
        lambda: ops(keys=k * 3, key_len=rng.choice([0, 5, 65, -1]),
                    lookup=groups([3], rng)),
        lambda: ops(keys=k * 2, key_lens=bytes([rng.randrange(0, 70), 16]),
                    lookup=groups([2], rng)),
        lambda: ops(keys=k * 3, key_len=w, store=groups([3], rng),
                    store_gpu=b"".join(x.to_bytes(4, "little", signed=True)
                                       for x in (-1, 2**31 - 1, 3))),
        lambda: ops(keys=k, key_len=w, load=groups([1], rng), load_gpu=b"\xff" * 4),
        lambda: ops(keys=k * 2, key_len=w, pin=groups([2], rng)),
        lambda: ops(keys=k * 2, key_len=w, commit=groups([2], rng), commit_ok=b"\x01"),
        lambda: ops(keys=k * 2, key_len=w, reserve=groups([1, 1], rng)),
        lambda: ops(keys=k * 2, key_len=w, release=groups([2], rng)),
        lambda: ops(keys=k * 300, key_len=w, lookup=groups([1] * 300, rng), lookup_status=True),
        lambda: ops(wait=[rng.randrange(10**9)], wait_s=rng.choice([0.01, -1.0, 1e9])),
        lambda: ops(contexts=[{"req_id": "r", "tiers": junk(rng), "hints": junk(rng)}]),
        lambda: ops(finish=["r" * rng.randrange(100_000)], step=True),
        lambda: {"v": V, "op": "kv_register", "id": i, "rank": rng.choice([0, -1, 99, 2**40]),
                 "registration": junk(rng)},
        lambda: {"v": V, "op": "kv_register", "id": i, "rank": 0, "registration": {"x": 1}},
        lambda: {"v": V, "op": "stats", "id": i, "verify": junk(rng)},
        lambda: {rng.randrange(10): 1},  # integer map keys
    ]
    raw: list[Callable[[], bytes]] = [
        lambda: b"\x85" + b"".join(map(pack, ("v", V, "op", "kv_register", "id", i, "rank", 0,
                                               "registration"))) + deep(rng.randrange(9, 1000)),
        lambda: b"\x84" + b"".join(map(pack, ("v", V, "op", "ops", "id", i, "finish")))
        + huge_array(300_000),
        lambda: deep(rng.randrange(100, 2000)),
        lambda: mutate(pack(ops(keys=k * 4, key_len=w, lookup=groups([4], rng))), rng),
        lambda: mutate(pack(ops(keys=k, key_len=w, store=groups([1], rng),
                                store_gpu=b"\x01\x00\x00\x00")), rng),
    ]
    if rng.random() < 0.25:
        return rng.choice(raw)()
    return pack(rng.choice(choices)())


def worker_input(rng: random.Random) -> bytes:
    choices: list[Callable[[], object]] = [
        lambda: {"v": V, "op": "worker_hello", "rank": rng.choice([0, 1, -1, 2**31]),
                 "world_size": rng.choice([1, 2, 0]), "pid": rng.choice([NO_PROCESS, 0, -5]),
                 "start_time": rng.choice([0, 1, 2**62]), "device": junk(rng)},
        lambda: {"v": V, "op": "worker_hello", "rank": 0, "world_size": 1, "pid": NO_PROCESS,
                 "registration": {"version": 1, "x": [[[[[[[[[[1]]]]]]]]]]}},
        lambda: {"v": V, "op": "hb"},
        lambda: {"v": V, "op": "transfer_done",
                 "results": [{"job_id": rng.randrange(-5, 10**9), "success": junk(rng)}]},
        lambda: {"v": V, "op": "kv_attached", "reg_id": rng.randrange(10**6), "ok": True},
        lambda: {"v": "w" * rng.randrange(1_000, 4_000_000), "op": "hb"},
        lambda: {"v": V, "op": "inventory", "keys": [], "last": True},
        lambda: {"v": V, "op": "bye", "reason": "b" * rng.randrange(100_000)},
    ]
    if rng.random() < 0.3:
        return mutate(pack(rng.choice(choices)()), rng)
    return pack(rng.choice(choices)())


def tier_input(rng: random.Random, namespace: str, bystander: int) -> bytes:
    choices: list[Callable[[], object]] = [
        lambda: {"v": V, "op": "tier_hello", "tier": rng.choice(["memory", "nope", ""]),
                 "type": junk(rng), "pid": rng.choice([NO_PROCESS, bystander, 0]),
                 "start_time": rng.choice([0, 1]), "namespace": rng.choice([namespace, "x"])},
        lambda: {"v": V, "op": "ready", "credit": rng.choice([-(2**40), 0, 10**9])},
        lambda: {"v": V, "op": "tier_done", "credit": junk(rng),
                 "results": [{"job_id": rng.randrange(-5, 10**9), "success": True,
                              "successful_keys": [os.urandom(9)]}]},
        lambda: {"v": V, "op": "inventory", "keys": [os.urandom(rng.randrange(0, 80))
                                                     for _ in range(rng.randrange(50))],
                 "last": junk(rng)},
        lambda: {"v": V, "op": "tier_stats", "stats": {"breaker": "open",
                                                       "n": [[[[[[1]]]]]]}},
        lambda: {"v": V, "op": "tier_stats", "stats": {str(i): i for i in range(5000)}},
        lambda: {"v": "t" * rng.randrange(1_000, 4_000_000), "op": "hb"},
    ]
    if rng.random() < 0.3:
        return mutate(pack(rng.choice(choices)()), rng)
    return pack(rng.choice(choices)())


# -- the broker process, seen from outside -------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Figures:
    inputs: dict[str, int] = field(default_factory=lambda: {"client": 0, "worker": 0,
                                                            "tier": 0})
    replies: int = 0
    checks: int = 0
    crashes: int = 0  # the broker's pid changed, or it stopped answering for good
    hangs: int = 0  # a stats probe slower than PROBE_S
    slowest_probe_s: float = 0.0
    roundtrips_bad: int = 0
    rss_mb: list[float] = field(default_factory=list)  # at each check
    fds: list[int] = field(default_factory=list)
    log_bytes: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        total = sum(self.inputs.values())
        return (f"{total:,} inputs ({', '.join(f'{k} {v:,}' for k, v in self.inputs.items())})"
                f" in {self.seconds:.0f} s; {self.checks} checks: crashes {self.crashes}, "
                f"hangs {self.hangs}, bad round trips {self.roundtrips_bad}, slowest probe "
                f"{self.slowest_probe_s:.2f} s; broker RSS {self.rss_mb[0]:.0f} -> "
                f"{self.rss_mb[-1]:.0f} MB (max {max(self.rss_mb):.0f}), fds {self.fds[0]} -> "
                f"{self.fds[-1]}, log {self.log_bytes[0]:,} -> {self.log_bytes[-1]:,} bytes")


class Campaign:
    """Sends inputs to the three sockets of `cluster`'s broker and checks its health."""

    def __init__(self, cluster: Cluster, seed: int, bystander: int) -> None:
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.bystander = bystander
        self.config = cluster.config
        self.client = Client(self.config.connect_address("client"), timeout=PROBE_S)
        self.broker = cluster.node.children["broker"]
        self.pid = self.broker.pid
        self.figures = Figures()
        self._sockets: dict[str, zmq.Socket] = {}
        self._sent: dict[str, int] = {}
        self._round = 0

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self.client.close()

    def run(self, per_socket: int, check_every: int = 1000) -> Figures:
        f = self.figures
        self.check()
        t0 = time.monotonic()
        links = ["client", "worker", "tier"]
        for n in range(per_socket * len(links)):
            link = links[n % len(links)]
            self._send(link, self._input(link))
            if (n + 1) % check_every == 0:
                self.check()
        self.check()
        f.seconds += time.monotonic() - t0
        return f

    def _input(self, link: str) -> bytes:
        if link == "client":
            return client_input(self.rng)
        if link == "worker":
            return worker_input(self.rng)
        return tier_input(self.rng, self.config.namespace, self.bystander)

    def _send(self, link: str, payload: bytes) -> None:
        sock = self._sockets.get(link)
        if sock is None or self._sent.get(link, 0) >= ROTATE_EVERY:
            if sock is not None:
                sock.close()
            sock = self._sockets[link] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, f"fuzz-{link}-{os.urandom(6).hex()}".encode())
            sock.connect(self.config.connect_address(link))
            self._sent[link] = 0
        try:
            sock.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the broker is not keeping up: what a flood is
        self._sent[link] += 1
        self.figures.inputs[link] += 1
        while sock.poll(0):  # answers and refusals: read, never needed
            sock.recv()
            self.figures.replies += 1

    def check(self) -> None:
        f = self.figures
        f.checks += 1
        t0 = time.monotonic()
        try:
            pid = int(self.client.stats()["pid"])
        except (BrokerUnavailable, RemoteError):
            pid = -1
        took = time.monotonic() - t0
        f.slowest_probe_s = max(f.slowest_probe_s, took)
        f.hangs += took > PROBE_S
        if pid != self.pid:
            f.crashes += 1
            return
        f.roundtrips_bad += not self._roundtrip()
        f.rss_mb.append(rss_bytes(self.pid) / 2**20)
        f.fds.append(open_fds(self.pid))
        f.log_bytes.append(self.broker.bytes_logged)

    def _roundtrip(self) -> bool:
        """A store and a load by the engine, compared byte for byte."""
        self._round += 1
        engine = self.cluster.clients[0]
        ks = keys(self._round * 2, self._round * 2 + 1, prefix=b"legit")
        try:
            self.cluster.fill(ks, [0, 1])
            store = engine.store(ks, [0, 1], req_id=f"legit{self._round}")
            if store.job_id is None or not engine.wait([store.job_id])[store.job_id].success:
                return False
            self.cluster.scramble([2, 3])
            load = engine.load(ks, [2, 3], req_id=f"legit{self._round}")
            ok = engine.wait([load.job_id])[load.job_id].success
            engine.finish(f"legit{self._round}")
            return ok and self.cluster.holds(ks, [2, 3])
        except (BrokerUnavailable, RemoteError, TimeoutError):
            return False
