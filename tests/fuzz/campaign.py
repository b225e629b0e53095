"""A campaign of hostile input against a running node, with health checks.

Every class of input the first campaign found something with, on all three sockets:
random bytes, truncated and oversized msgpack, wrong types, deep nesting, huge
arrays, out-of-range ids, unknown ops, hostile registrations (client); mangled
hellos, forged heartbeats, completions and attach replies (worker); mangled hellos
naming other processes, forged credit, completions, inventories and stats (tier).
Every `check_every` inputs the node must still be the same broker (pid unchanged),
answer a stats probe within `PROBE_S`, and carry a legitimate store and load
byte-exact; the broker's RSS, open fds and log bytes are recorded before and after.

`CrossPeerCampaign` is the cross-peer mode: real clients acting on one key
space and on each other's reservations, pins and jobs, forged hellos for the live
worker and tier, messages over every protocol limit (see its section below).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import zmq

from tests.integration.cluster import Cluster, key_bytes, keys, step_until, store_when_room
from tierkv.client import Batch, BrokerUnavailable, Client, RemoteError
from tierkv.core.shm import SharedRegion, process_start_time
from tierkv.node.children import tier_secret
from tierkv.wire.keyblob import pack_counts
from tierkv.wire.protocol import (
    KEY_SECTIONS,
    MAX_CONTEXTS,
    MAX_FINISH,
    MAX_GROUPS,
    MAX_LIST,
    MAX_MESSAGE_BYTES,
    MAX_QUEUE_CHAINS,
    MAX_STEP_KEYS,
    MAX_WAIT,
    PROTOCOL_VERSION,
    AttachedKV,
    Heartbeat,
    Inventory,
    KeyGroups,
    Message,
    OpsRequest,
    Ready,
    RegisterKVRequest,
    Reply,
    RequestContext,
    StatsRequest,
    TierHello,
    TransferDoneBatch,
    TransferOutcome,
    WorkerHello,
    decode,
    encode,
)

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
    roundtrip_failures: list[str] = field(default_factory=list)  # the first few, why

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

    def _socket(self, name: str, link: str) -> zmq.Socket:
        """A DEALER on `link` for the inputs called `name`, under a new identity every
        ROTATE_EVERY sends."""
        sock = self._sockets.get(name)
        if sock is None or self._sent.get(name, 0) >= ROTATE_EVERY:
            if sock is not None:
                sock.close()
            sock = self._sockets[name] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, f"fuzz-{name}-{os.urandom(6).hex()}".encode())
            sock.connect(self.config.connect_address(link))
            self._sent[name] = 0
        self._sent[name] += 1
        return sock

    def _send(self, link: str, payload: bytes) -> None:
        sock = self._socket(link, link)
        try:
            sock.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the broker is not keeping up: what a flood is
        self.figures.inputs[link] = self.figures.inputs.get(link, 0) + 1
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
        """A store and a load by the engine, compared byte for byte. A store refused
        for want of room (other clients hold every row) is asked again."""
        self._round += 1
        engine = self.cluster.clients[0]
        ks = keys(self._round * 2, self._round * 2 + 1, prefix=b"legit")
        req = f"legit{self._round}"
        try:
            self.cluster.fill(ks, [0, 1])
            store = store_when_room(engine, ks, [0, 1], req)
            done = engine.wait([store.job_id])[store.job_id] if store.job_id else None
            if done is None or not done.success:
                return self._failed(f"store {store} -> {done}")
            self.cluster.scramble([2, 3])
            load = engine.load(ks, [2, 3], req)
            done = engine.wait([load.job_id])[load.job_id]
            engine.finish(req)
            if done.success and self.cluster.holds(ks, [2, 3]):
                return True
            return self._failed(f"load {done}, exact {self.cluster.holds(ks, [2, 3])}")
        except (BrokerUnavailable, RemoteError, TimeoutError) as e:
            return self._failed(repr(e))

    def _failed(self, why: str) -> bool:
        if len(self.figures.roundtrip_failures) < 10:
            self.figures.roundtrip_failures.append(why)
        return False


# -- the cross-peer mode ----------------------------------------------------------------------
#
# Several real clients share one small key space and act on each other's state: every
# commit, release, store and load is judged against what each client holds by its own
# account (an `Actor`), so an operation on another's reservation, pin or KV cache that
# the broker accepts is counted, and so is one on its own that it refuses. Every
# block anyone writes holds the bytes derived from its key (`key_bytes`), so every
# read (a pinned CPU row, a loaded GPU block) is checked byte for byte. Between
# them: forged worker and tier hellos naming the live processes, oversized messages,
# clients that close and reconnect or vanish, and the first campaign's junk.

# A node where one client may hold 8 of the 64 CPU blocks (the actors, the prober and
# a ghost or two can hold at most about 46), reservations and pins end after 5 s,
# and a silent client after 4 s (the campaign's clients ping every second); the
# memory tier holds every block ever stored, so a probe is never lost for want of
# room, only evicted from the CPU tier (and promoted again when probed).
CROSS_NODE: dict = dict(
    gpu_blocks=64, cpu={"num_blocks": 64},
    broker={"heartbeat_s": 0.5, "owner_timeout_s": 4.0, "reservation_s": 5.0, "pin_s": 5.0,
            "owner_share": 0.125},
    tiers=[{"type": "memory", "capacity_blocks": 4096, "threads": 2}])
PING_S = 1.0  # the campaign's clients: well inside broker.owner_timeout_s
# The key space every actor works on: half again the CPU tier, so that keys come and
# go (stores and reservations have something to do, pins and loads find hits).
SHARED_KEYS = keys(*range(96), prefix=b"x")
ROUNDTRIP_GPU = [0, 1, 2, 3]  # `Campaign._roundtrip`'s blocks
PROBE_SRC = [4, 5, 6, 7]  # the prober's first probe keys are stored from these
PROBE_DST = list(range(8, 16))  # and loaded into these
ACTOR_GPU = 12  # GPU blocks of each actor, from 16 up
PROBES_PER_CHECK = 8

# An operation on another's state is refused with one of these (anything else is
# counted in `odd_codes`); an accepted one is counted in `cross_accepted`.
FOREIGN_CODES = {"commit": {"not_owner"}, "release": {"not_owner", "expired"},
                 "store": {"not_owner"}, "load": {"not_owner"}}

KINDS: dict[str, float] = {
    "reserve": 12, "commit": 8, "abort": 3, "commit_other": 10, "commit_mixed": 2,
    "pin": 8, "lookup_pin": 6, "lookup": 6, "release": 8, "release_other": 10,
    "store": 8, "load": 8, "finish": 3, "step": 5, "close": 0.5, "ghost": 0.3,
    "forge_worker": 2, "forge_tier": 2, "oversized": 3, "junk": 3,
}


def child_kind(name: str) -> str:
    """broker, worker or tier, by the supervisor's name of a child (`Node.specs`)."""
    return "worker" if name.startswith("worker") else name.split(":")[0]


class BrokerGone(Exception):
    """The broker exited (or another answers in its place), or a child of the node
    did: the campaign stops."""


@dataclass(eq=False)
class Actor:
    """A real client of the cross-peer mode and what it holds, by its own account."""

    name: str
    client: Client
    tokens: bool  # given the engine's KV registration tokens (`Client.use_kv`)
    gpu: list[int]  # its own GPU blocks: no other actor reads or writes them
    free: list[int]  # of those, the ones no job of its has in flight
    reserved: dict[bytes, int] = field(default_factory=dict)  # key -> row (withdrawn too)
    pins: dict[bytes, list[float]] = field(default_factory=dict)  # key -> when pinned
    unsure: set[bytes] = field(default_factory=set)  # keys whose pins may have expired
    jobs: dict[int, tuple[str, list[bytes], list[int]]] = field(default_factory=dict)
    parked: list[tuple[float, list[int]]] = field(default_factory=list)  # (reusable at, blocks)

    def take_blocks(self, n: int, now: float) -> list[int] | None:
        for at, blocks in list(self.parked):
            if now >= at:
                self.parked.remove((at, blocks))
                self.free.extend(blocks)
        if len(self.free) < n:
            return None
        taken, self.free = self.free[:n], self.free[n:]
        return taken


@dataclass
class CrossFigures(Figures):
    kinds: Counter = field(default_factory=Counter)  # inputs by kind
    codes: Counter = field(default_factory=Counter)  # refusals by code
    unanswered: int = 0  # client calls that timed out (BrokerUnavailable)
    jobs_unfinished: int = 0  # store and load jobs with no result within their deadline
    fatal: int = 0  # replies saying the broker failed to handle a request
    cross_accepted: int = 0  # an operation on another's state, accepted
    own_refused: int = 0  # an operation on its own state, refused `not_owner`
    odd_codes: int = 0  # an operation on another's state refused with an unexpected code
    forged: int = 0  # forged peer messages sent
    forged_welcomed: int = 0
    forged_unanswered: int = 0
    oversized: int = 0
    oversized_accepted: int = 0
    oversized_unanswered: int = 0
    answered_without_id: int = 0  # refused under id 0: a client cannot tell it is its reply
    at_limit_refused: int = 0
    slowest_refusal_s: float = 0.0
    reads: int = 0  # CPU rows read under a pin and GPU blocks read after a load
    wrong_bytes: int = 0
    probes: int = 0  # probe keys loaded by the prober
    probes_exact: int = 0
    probes_unavailable: int = 0
    probe_holds_lost: int = 0  # the prober's reservation or pin refused `not_owner`
    probe_holds_expired: int = 0
    invariant_violations: list[str] = field(default_factory=list)
    fenced: int = 0
    peer_deaths: int = 0
    children_changed: list[str] = field(default_factory=list)
    reconnects: int = 0
    ghosts: int = 0
    jobs_done: Counter = field(default_factory=Counter)  # "store ok", "load failed", ...
    end: dict = field(default_factory=dict)  # the node once every client has ended
    anomalies: list[str] = field(default_factory=list)  # the first of each kind, in words
    noted: Counter = field(default_factory=Counter)  # anomalies by kind
    logs: dict[str, str] = field(default_factory=dict)  # children's last lines, if one died

    def note(self, what: str) -> None:
        """Keep the first three of each kind (what comes before the first colon)."""
        kind = what.split(":")[0]
        self.noted[kind] += 1
        if self.noted[kind] <= 3:
            self.anomalies.append(what)

    def faults(self) -> dict[str, object]:
        """Everything that must be zero (or empty); the test asserts it is."""
        return {k: v for k, v in {
            "crashes": self.crashes, "hangs": self.hangs,
            "bad round trips": self.roundtrip_failures if self.roundtrips_bad else 0,
            "unanswered": self.unanswered, "jobs unfinished": self.jobs_unfinished,
            "fatal": self.fatal, "cross accepted": self.cross_accepted,
            "own refused": self.own_refused, "odd codes": self.odd_codes,
            "forged welcomed": self.forged_welcomed,
            "forged unanswered": self.forged_unanswered,
            "oversized accepted": self.oversized_accepted,
            "oversized unanswered": self.oversized_unanswered,
            "answered without its id": self.answered_without_id,
            "at a limit refused": self.at_limit_refused,
            "wrong bytes": self.wrong_bytes, "probes not exact": self.probes - self.probes_exact,
            "probes unavailable": self.probes_unavailable,
            "probe holds lost": self.probe_holds_lost,
            "invariants": self.invariant_violations, "fenced": self.fenced,
            "peer deaths": self.peer_deaths, "children changed": self.children_changed,
        }.items() if v}

    def line(self) -> str:
        total = sum(self.kinds.values())
        end = self.end
        rss, fds, log = self.rss_mb or [0.0], self.fds or [0], self.log_bytes or [0]
        return (f"{total:,} inputs in {self.seconds:.0f} s, {self.checks} checks; faults "
                f"{self.faults() or 'none'}; refusals {dict(self.codes.most_common())}; "
                f"jobs {dict(self.jobs_done)}; {self.reads:,} reads and {self.probes} probe "
                f"loads checked byte for byte; {self.forged:,} forged peer messages, "
                f"{self.oversized:,} oversized (slowest refusal {self.slowest_refusal_s:.2f} s); "
                f"{self.reconnects} reconnects, {self.ghosts} vanished; slowest stats probe "
                f"{self.slowest_probe_s:.2f} s; broker RSS "
                f"{rss[0]:.0f} -> {rss[-1]:.0f} MB (max {max(rss):.0f}), fds {fds[0]} -> "
                f"{fds[-1]}, log {log[0]:,} -> {log[-1]:,} bytes; at the end {end}")


def _blob(n: int) -> bytes:
    return np.arange(n, dtype=">u8").tobytes()  # n distinct 8-byte keys


def _ones(n: int) -> KeyGroups:
    return KeyGroups(np.ones(n, "<i4").tobytes())  # n groups of one key


def _ops(request_id: int, **fields: object) -> bytes:
    return encode(OpsRequest(request_id, **fields))  # type: ignore[arg-type]


def _section_over(name: str) -> Callable[[int], bytes]:
    n = (MAX_QUEUE_CHAINS if name == "queue" else MAX_GROUPS) + 1
    extra = {"commit": {"commit_ok": b"\x01" * n}, "store": {"store_gpu": bytes(4 * n)},
             "load": {"load_gpu": bytes(4 * n)}}.get(name, {})
    return lambda i: _ops(i, keys=_blob(n), key_len=8, **{name: _ones(n)}, **extra)


_OVER = MAX_STEP_KEYS + 1
# Messages over each of the protocol's limits, by name: each must be refused, and
# answered under its request id. A frame over MAX_MESSAGE_BYTES is not among them:
# libzmq drops it with its connection before it is read (`tierkv.wire.sockets`).
OVER_LIMIT: dict[str, Callable[[int], bytes]] = {
    "keys": lambda i: _ops(i, keys=_blob(_OVER), key_len=8, lookup=KeyGroups(pack_counts([_OVER]))),
    "keys of their own lengths": lambda i: _ops(i, keys=_blob(_OVER), key_lens=b"\x08" * _OVER,
                                                lookup=KeyGroups(pack_counts([_OVER]))),
    **{f"{name} groups": _section_over(name) for name in KEY_SECTIONS},
    "contexts": lambda i: _ops(i, contexts=[RequestContext(f"r{n}")
                                            for n in range(MAX_CONTEXTS + 1)]),
    "finish": lambda i: _ops(i, finish=["r"] * (MAX_FINISH + 1)),
    "wait": lambda i: _ops(i, wait=list(range(MAX_WAIT + 1)), wait_s=0.01),
    "kv_tokens": lambda i: _ops(i, kv_tokens=["0" * 32] * 65),
    "list items": lambda i: _ops(i, finish=["r"] * (MAX_LIST + 1)),
    "registration values": lambda i: encode(RegisterKVRequest(i, 0, {
        "version": 1, "device": "cpu", "layout": {}, "tensors": [0] * 100_001})),
}
# ... and exactly at a limit: legal, and served.
AT_LIMIT: dict[str, Callable[[int], bytes]] = {
    "keys at the limit": lambda i: _ops(i, keys=_blob(MAX_STEP_KEYS), key_len=8,
                                        lookup=KeyGroups(pack_counts([MAX_STEP_KEYS]))),
    "groups at the limit": lambda i: _ops(i, keys=_blob(MAX_GROUPS), key_len=8,
                                          lookup=_ones(MAX_GROUPS)),
}
TOO_MANY_BYTES = "message bytes"  # one byte over MAX_MESSAGE_BYTES
# Every case once, in this order, then at random.
LIMIT_CASES = [*OVER_LIMIT, *AT_LIMIT, TOO_MANY_BYTES]


def limit_case(name: str, request_id: int) -> bytes:
    if name == TOO_MANY_BYTES:
        return pack({"v": V, "op": "ops", "id": request_id, "keys": bytes(MAX_MESSAGE_BYTES)})
    return {**OVER_LIMIT, **AT_LIMIT}[name](request_id)


class CrossPeerCampaign(Campaign):
    """The cross-peer mode: `actors` real clients (the first `with_tokens` of
    them given the engine's KV tokens) interleave every operation on one small key
    space and on each other's keys; the engine (`cluster.clients[0]`, which
    registered the KV cache) is the prober. `run` then `finish`."""

    def __init__(self, cluster: Cluster, seed: int, bystander: int, actors: int = 4,
                 with_tokens: int = 2) -> None:
        super().__init__(cluster, seed, bystander)
        self.client.ping_s = PING_S
        self.engine = cluster.clients[0]
        self.engine.ping_s = PING_S
        self.figures: CrossFigures = CrossFigures()
        self.broker_cfg = self.config.broker
        self.region = SharedRegion.attach(self.config.instance)
        self.page = self.region.layout.page_size
        self.ranks = self.config.cpu.world_size
        self.actors = [self._actor(i, i < with_tokens) for i in range(actors)]
        self.children = {name: child.pid for name, child in cluster.node.children.items()}
        self.probe_keys: list[bytes] = []
        self.pending: tuple[list[bytes], list[int]] | None = None  # the prober's reservation
        self.probe_pins: tuple[list[bytes], list[int], float] | None = None
        self.maybe_ready: list[bytes] = []  # keys someone stored or committed lately
        self._n = 0  # names of requests, probe keys and the like

    def close(self) -> None:
        for actor in self.actors:
            actor.client.close()
        self.region.close()
        super().close()

    # -- the run ----------------------------------------------------------------------

    def run(self, inputs: int, check_every: int = 1000) -> CrossFigures:  # type: ignore[override]
        f = self.figures
        t0 = time.monotonic()
        self._first_probes()
        self.check()
        names, weights = list(KINDS), list(KINDS.values())
        try:
            for n in range(inputs):
                kind = self.rng.choices(names, weights)[0]
                f.kinds[kind] += 1
                self._input_of(kind)
                if (n + 1) % check_every == 0:
                    self.check()
            self.finish()
        except BrokerGone as e:
            f.note(f"the broker is gone ({e}): the campaign stops")
        f.seconds += time.monotonic() - t0
        return f

    def _unanswered(self, what: str) -> None:
        """A request got no answer: counted; if the broker has exited, the run ends."""
        self.figures.unanswered += 1
        self.figures.note(f"unanswered: {what}")
        code = self.broker.proc.poll()
        if code is not None:
            self.figures.crashes += 1
            raise BrokerGone(f"exit status {code}")

    def _input_of(self, kind: str) -> None:
        if kind == "forge_worker":
            return self._forge("worker")
        if kind == "forge_tier":
            return self._forge("tier")
        if kind == "oversized":
            return self._oversized()
        if kind == "junk":
            link = self.rng.choice(["client", "worker", "tier"])
            return self._send(link, self._input(link))
        actor = self.rng.choice(self.actors)
        try:
            getattr(self, f"_{kind}")(actor)
        except RemoteError as e:
            # What is not caught on the way is a refusal of the actor's own business
            # (operations on others' state and its commits and releases say theirs).
            self._refused(e, f"{actor.name} {kind}")
            if e.code == "not_owner":
                self.figures.own_refused += 1
                self.figures.note(f"own {kind} refused: {actor.name}: {e.message}")
        except BrokerUnavailable:
            self._unanswered(f"{actor.name} {kind}")
            self._reconnect(actor, wait=False)  # what it holds is unknown now

    def _refused(self, e: RemoteError, what: str) -> None:
        self.figures.codes[e.code] += 1
        if e.code == "fatal":
            self.figures.fatal += 1
            self.figures.note(f"fatal: {what}: {e.message}")

    # -- what each actor does ---------------------------------------------------------

    def _req(self) -> str:
        return f"r{self.rng.randrange(6)}"  # few names: every owner has its own "r1"

    def _shared(self, most: int = 3) -> list[bytes]:
        return self.rng.sample(SHARED_KEYS, self.rng.randint(1, most))

    def _readable(self, most: int = 3) -> list[bytes]:
        pool = SHARED_KEYS + self.probe_keys[-8:]
        return self.rng.sample(pool, self.rng.randint(1, most))

    def _victims(self, actor: Actor) -> list[bytes]:
        """Keys someone else holds: another actor's reservations, pins and keys in
        flight, the prober's reservation and pins, the probe keys."""
        others = [a for a in self.actors if a is not actor]
        sources = [list(a.reserved) for a in others] + [list(a.pins) for a in others]
        sources += [ks for a in others for _, ks, _ in a.jobs.values()]
        if self.pending:
            sources.append(self.pending[0])
        if self.probe_pins:
            sources.append(self.probe_pins[0])
        sources.append(self.probe_keys[-8:])
        sources = [s for s in sources if s]
        pool = self.rng.choice(sources) if sources else SHARED_KEYS
        return self.rng.sample(pool, self.rng.randint(1, min(3, len(pool))))

    def _reserve(self, actor: Actor) -> None:
        ks = self._shared()
        r = actor.client.reserve(ks, self._req())
        if r.ok:
            for key, row in zip(ks, r.block_ids, strict=True):
                if row >= 0:
                    self._write_row(key, row)  # written at once; committed later, or not
                    actor.reserved[key] = row

    def _commit(self, actor: Actor, ok: bool = True) -> None:
        if not actor.reserved:
            return self._reserve(actor)
        ks = self.rng.sample(list(actor.reserved), self.rng.randint(1, min(3, len(actor.reserved))))
        try:
            actor.client.commit(ks, ok)
        except RemoteError as e:
            self._refused(e, f"{actor.name} commit")
            if e.code != "expired":  # nothing else may refuse what it reserved
                self.figures.own_refused += 1
                self.figures.note(f"own commit refused: {actor.name}: {e.code}: {e.message}")
                if e.code != "not_owner":
                    self._reconnect(actor, wait=True)  # its state is unknown now
                return
        for key in ks:
            del actor.reserved[key]
        if ok:
            self.maybe_ready = (self.maybe_ready + ks)[-32:]

    def _abort(self, actor: Actor) -> None:
        self._commit(actor, ok=False)

    def _commit_other(self, actor: Actor) -> None:
        ks = [k for k in self._victims(actor) if k not in actor.reserved]
        if ks:
            self._foreign(actor, "commit", lambda: actor.client.commit(ks, self.rng.random() < .7))

    def _commit_mixed(self, actor: Actor) -> None:
        """Its own reservation with another's key: refused whole; its own stays."""
        ks = [k for k in self._victims(actor) if k not in actor.reserved][:1]
        if not actor.reserved or not ks:
            return self._reserve(actor)
        mine = self.rng.choice(list(actor.reserved))
        both = self.rng.sample([mine, *ks], 2)
        self._foreign(actor, "commit", lambda: actor.client.commit(both, True))

    def _foreign(self, actor: Actor, op: str, call: Callable[[], object]) -> None:
        """An operation on what the actor does not hold: must be refused."""
        f = self.figures
        try:
            call()
        except RemoteError as e:
            self._refused(e, f"{actor.name} {op} of another's")
            if e.code not in FOREIGN_CODES[op]:
                f.odd_codes += 1
                f.note(f"foreign {op} refused {e.code}: {actor.name}: {e.message}")
            return
        f.cross_accepted += 1
        f.note(f"foreign {op} accepted: {actor.name}")

    def _pin(self, actor: Actor) -> None:
        ks = self._readable()
        rows = actor.client.pin(ks, self._req())
        self._pinned(actor, ks, rows)

    def _lookup_pin(self, actor: Actor) -> None:
        ks = self._readable(4)
        found = actor.client.lookup(ks, self._req(), status=self.rng.random() < 0.3, pin=True)
        self._pinned(actor, ks, found.rows or [])

    def _lookup(self, actor: Actor) -> None:
        actor.client.lookup(self._readable(4), self._req(), status=self.rng.random() < 0.5)

    def _pinned(self, actor: Actor, ks: list[bytes], rows: list[int]) -> None:
        now = time.monotonic()
        for key, row in zip(ks, rows, strict=True):
            if row < 0:
                continue
            self._check_row(key, row, f"{actor.name}'s pin")
            held = actor.pins.setdefault(key, [])
            if held and now - held[-1] > self.broker_cfg.pin_s / 2:
                actor.unsure.add(key)  # that pin may have expired: this is its new count
            held.append(now)

    def _release(self, actor: Actor) -> None:
        if not actor.pins:
            return self._lookup_pin(actor)
        ks = self.rng.sample(list(actor.pins), self.rng.randint(1, min(3, len(actor.pins))))
        try:
            actor.client.release(ks)
        except RemoteError as e:
            self._refused(e, f"{actor.name} release")
            culprit = next((k for k in ks if k.hex()[:32] in e.message), None)
            if culprit is None or e.code not in ("not_owner", "expired"):
                self.figures.own_refused += 1
                self.figures.note(f"own release refused: {actor.name}: {e.code}: {e.message}")
                self._reconnect(actor, wait=True)  # its state is unknown now
                return
            young = time.monotonic() - actor.pins[culprit][-1] < self.broker_cfg.pin_s / 2
            if e.code == "not_owner" and young and culprit not in actor.unsure:
                self.figures.own_refused += 1
                self.figures.note(f"own release refused: {actor.name}: {e.message}")
            self._unpin(actor, culprit, all_of_it=True)  # expired, or never counted right
            return
        for key in ks:
            self._unpin(actor, key)

    @staticmethod
    def _unpin(actor: Actor, key: bytes, all_of_it: bool = False) -> None:
        held = actor.pins[key]
        del held[: len(held) if all_of_it else 1]
        if not held:
            del actor.pins[key]
            actor.unsure.discard(key)

    def _release_other(self, actor: Actor) -> None:
        ks = [k for k in self._victims(actor) if k not in actor.pins]
        if ks:
            self._foreign(actor, "release", lambda: actor.client.release(ks))

    def _store(self, actor: Actor) -> None:
        ks = self._shared()
        if not actor.tokens:  # into anyone's blocks, the prober's among them
            gpu = self.rng.sample(range(self.cluster.layout.num_blocks), len(ks))
            return self._foreign(actor, "store", lambda: actor.client.store(ks, gpu))
        gpu = actor.take_blocks(len(ks), time.monotonic())
        if gpu is None:
            return self._step(actor)
        self.cluster.fill(ks, gpu)
        store = None
        try:
            store = actor.client.store(ks, gpu, self._req())
        finally:
            if store is not None and store.job_id is not None:
                actor.jobs[store.job_id] = ("store", ks, gpu)
            else:
                actor.free.extend(gpu)

    def _load(self, actor: Actor) -> None:
        pool = self.maybe_ready or SHARED_KEYS
        ks = self.rng.sample(pool, self.rng.randint(1, min(3, len(pool))))
        if not actor.tokens:
            gpu = self.rng.sample(ROUNDTRIP_GPU + PROBE_SRC + PROBE_DST, len(ks))
            return self._foreign(actor, "load", lambda: actor.client.load(ks, gpu))
        gpu = actor.take_blocks(len(ks), time.monotonic())
        if gpu is None:
            return self._step(actor)
        self.cluster.scramble(gpu)
        req = self._req()
        load = None
        try:
            if self.rng.random() < 0.5:  # a lease first: the load takes its reader over
                actor.client.lookup(ks, req)
            load = actor.client.load(ks, gpu, req)
        finally:
            if load is not None:
                actor.jobs[load.job_id] = ("load", ks, gpu)
            else:
                actor.free.extend(gpu)

    def _finish(self, actor: Actor) -> None:
        actor.client.finish(self._req())

    def _step(self, actor: Actor) -> None:
        step = actor.client.step() if self.rng.random() < 0.7 else actor.client.poll()
        self._finished(actor, step.finished)

    def _finished(self, actor: Actor, results: list) -> None:
        f = self.figures
        for result in results:
            job = actor.jobs.pop(result.job_id, None)
            if job is None:
                continue
            kind, ks, gpu = job
            f.jobs_done[f"{kind} {'ok' if result.success else 'failed'}"] += 1
            if kind == "load" and result.success:
                f.reads += len(ks)
                if not self.cluster.holds(ks, gpu):
                    f.wrong_bytes += 1
                    f.note(f"wrong load: {actor.name}: {[k.hex() for k in ks]}")
            elif kind == "store" and result.success:
                self.maybe_ready = (self.maybe_ready + ks)[-32:]
            actor.free.extend(gpu)

    def _reconnect(self, actor: Actor, wait: bool = True, again: bool = True) -> None:
        """Close (`bye`: the broker lets go of all it held) and connect again, a new
        owner. Without waiting, the GPU blocks of its jobs in flight stay unused until
        those jobs are past their deadline."""
        f = self.figures
        if wait and actor.jobs:
            try:
                self._finished(actor, list(actor.client.wait(
                    list(actor.jobs), timeout=self.broker_cfg.job_timeout_s + 5).values()))
            except (TimeoutError, BrokerUnavailable) as e:
                f.jobs_unfinished += len(actor.jobs)
                f.note(f"jobs unfinished: {actor.name} before it closed: {e}")
        if actor.jobs:
            at = time.monotonic() + self.broker_cfg.job_timeout_s + 1
            actor.parked.extend((at, gpu) for _, _, gpu in actor.jobs.values())
        actor.client.close()
        if not again:
            return
        f.reconnects += 1
        fresh = self._actor(int(actor.name[5:]), actor.tokens)
        actor.client, actor.reserved, actor.pins, actor.unsure, actor.jobs = (
            fresh.client, {}, {}, set(), {})

    def _close(self, actor: Actor) -> None:
        self._reconnect(actor, wait=self.rng.random() < 0.5)

    def _actor(self, i: int, tokens: bool) -> Actor:
        client = self.cluster.client()  # given the engine's tokens (Client.use_kv)
        client.ping_s = PING_S
        if not tokens:
            client.registration_tokens.clear()
        gpu = list(range(16 + ACTOR_GPU * i, 16 + ACTOR_GPU * (i + 1))) if tokens else []
        return Actor(f"actor{i}", client, tokens, gpu, list(gpu))

    def _ghost(self, actor: Actor) -> None:
        """A client that reserves and pins, then vanishes without a word: the broker
        ends it after `owner_timeout_s` and lets go of what it held."""
        f = self.figures
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, b"ghost" + os.urandom(8))
        sock.connect(self.config.connect_address("client"))
        try:
            request = Batch(actor.client).reserve(self._shared(), "g") \
                .lookup(self._readable(), "g", pin=True).request(1)
            sock.send(encode(request))
            f.ghosts += 1
            if not sock.poll(int(self.config.client.timeout_s * 1000)):
                self._unanswered("a ghost's reserve")
        finally:
            sock.close()

    # -- forged peers and oversized messages --------------------------------------------

    def _forge(self, link: str) -> None:
        """A hello for the live rank or tier that names its process (pid and start
        time, both public) with a token this node did not give it, and what a
        welcomed peer would send next: every message must be refused."""
        f = self.figures
        rng = self.rng
        name = next(n for n in self.children if child_kind(n) == link)
        pid = self.children[name]
        start = process_start_time(pid)
        if not start:
            self._lost_child(name)
        token = rng.choice([secrets.token_hex(16), "", self._recorded_digest(),
                            tier_secret(self.config.tier_secret_path, create=False)
                            if link == "worker" else secrets.token_hex(32)])
        jobs = [j for a in self.actors for j in a.jobs] or [rng.randrange(1, 10**6)]
        messages: list[Message]
        if link == "worker":
            registration = rng.choice([None, self.cluster.kv[0].registration()])
            messages = [WorkerHello(0, self.ranks, pid, start, registration=registration,
                                    token=token,
                                    registration_token=rng.choice(["", secrets.token_hex(16)])),
                        TransferDoneBatch([TransferOutcome(j, True) for j in jobs[:8]]),
                        AttachedKV(rng.randrange(1, 100), True), Heartbeat()]
        else:
            messages = [TierHello("memory", "memory", pid, start,
                                  namespace=self.config.namespace, token=token),
                        Ready(10**6), Inventory(self.probe_keys[-8:], True), Heartbeat()]
        sock = self._socket(f"forged-{link}", link)
        for msg in messages:
            sock.send(encode(msg))
        f.forged += len(messages)
        for msg in messages:
            if not sock.poll(int(PROBE_S * 1000)):
                f.forged_unanswered += 1
                self._unanswered(f"a forged {type(msg).__name__} on the {link} link")
                break
            answer = decode(sock.recv())
            if type(answer).__name__ != "Refused":
                f.forged_welcomed += 1
                f.note(f"forged {link} welcomed: {type(answer).__name__} (token {token[:8]!r})")

    def _recorded_digest(self) -> str:
        """A digest the supervisor's record holds: evidence of a token, not a token."""
        try:
            digests = list(json.loads((self.config.run_path / "children.json").read_text()))
        except (OSError, ValueError):
            return ""
        return self.rng.choice(digests) if digests else ""

    def _oversized(self) -> None:
        """A message over a limit (or at one): refused (served) and answered under its
        own request id. A frame over MAX_MESSAGE_BYTES is dropped by libzmq unread,
        with its connection (by design): a stats request after it must be answered."""
        f = self.figures
        n = f.oversized
        f.oversized += 1
        roll = self.rng.random()
        name = (LIMIT_CASES[n] if n < len(LIMIT_CASES) else TOO_MANY_BYTES if roll < 0.03
                else self.rng.choice(list(AT_LIMIT)) if roll < 0.10
                else self.rng.choice(list(OVER_LIMIT)))
        self._n += 1
        request_id = 1_000_000 + self._n
        sock = self._socket("oversized", "client")
        t0 = time.monotonic()
        sock.send(limit_case(name, request_id))
        if name == TOO_MANY_BYTES:
            f.codes["dropped unread (MAXMSGSIZE)"] += 1
            request_id += 500_000
            sock.send(encode(StatsRequest(request_id)))
        reply = self._reply(sock, request_id)
        if reply is None:
            f.oversized_unanswered += 1
            self._unanswered(f"an oversized message ({name})")
        elif name in AT_LIMIT:
            if not reply.ok:
                f.at_limit_refused += 1
                f.note(f"at a limit refused: {name}: {reply.error}")
        elif name != TOO_MANY_BYTES:
            f.slowest_refusal_s = max(f.slowest_refusal_s, time.monotonic() - t0)
            if reply.ok:
                f.oversized_accepted += 1
                f.note(f"over a limit accepted: {name}")
            elif reply.error is not None:
                f.codes[reply.error.code] += 1
            if reply.id != request_id:
                f.answered_without_id += 1
                f.note(f"answered without its id: {name}: the reply names id {reply.id}")

    def _reply(self, sock: zmq.Socket, request_id: int) -> Reply | None:
        """The reply to `request_id` (or one under id 0: a request whose id the broker
        could not read), within the client timeout; None if none came."""
        deadline = time.monotonic() + self.config.client.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                return None
            reply = decode(sock.recv())
            if isinstance(reply, Reply) and reply.id in (request_id, 0):
                return reply

    # -- the prober and the checks --------------------------------------------------------

    def _write_row(self, key: bytes, row: int) -> None:
        for rank in range(self.ranks):
            self.region.page(row, rank)[:] = key_bytes(key, rank, self.page)

    def _check_row(self, key: bytes, row: int, what: str) -> bool:
        self.figures.reads += 1
        exact = all(bytes(self.region.page(row, rank)) == key_bytes(key, rank, self.page)
                    for rank in range(self.ranks))
        if not exact:
            self.figures.wrong_bytes += 1
            self.figures.note(f"wrong row: {what}: row {row} of key {key.hex()}")
        return exact

    def _fresh_probe_keys(self, n: int) -> list[bytes]:
        self._n += 1
        return keys(*range(self._n * 8, self._n * 8 + n), prefix=b"probe")

    def _first_probes(self) -> None:
        ks = self._fresh_probe_keys(len(PROBE_SRC))
        self.cluster.fill(ks, PROBE_SRC)
        store = self.engine.store(ks, PROBE_SRC, "probe")
        assert store.job_id is not None and store.keys_accepted == ks, store
        assert self.engine.wait([store.job_id])[store.job_id].success
        self.probe_keys.extend(ks)

    def _probe(self, final: bool) -> None:
        """The engine's reservation from the last check is written and committed, its
        pins read and released (others were attacking them since); a sample of the
        probe keys is found and loaded byte-exact; then new holds for others to attack."""
        e = self.engine
        if self.pending is not None:
            ks, rows = self.pending
            self.pending = None
            for key, row in zip(ks, rows, strict=True):
                self._write_row(key, row)
            if self._probe_hold("commit", lambda: e.commit(ks)):
                self.probe_keys.extend(ks)
        if self.probe_pins is not None:
            ks, rows, at = self.probe_pins
            self.probe_pins = None
            if time.monotonic() - at < self.broker_cfg.pin_s / 2:
                for key, row in zip(ks, rows, strict=True):
                    self._check_row(key, row, "the prober's pin")
            for key in ks:  # one by one: a pin past its deadline refuses only its own
                self._probe_hold("release", lambda key=key: e.release([key]))
        sample = self.rng.sample(self.probe_keys, min(PROBES_PER_CHECK, len(self.probe_keys)))
        self.probe_load(sample)
        if final:
            return
        ks = self._fresh_probe_keys(2)
        reserved = e.reserve(ks, "pending")
        if reserved.ok and min(reserved.block_ids) >= 0:
            self.pending = (ks, reserved.block_ids)
        self._n += 1
        req = f"pins{self._n}"
        found = e.lookup(sample[:4], req, pin=True)
        pinned = [(k, r) for k, r in zip(sample[:4], found.rows or [], strict=True) if r >= 0]
        for key, row in pinned:
            self._check_row(key, row, "the prober's pin")
        if pinned:
            self.probe_pins = ([k for k, _ in pinned], [r for _, r in pinned], time.monotonic())
        e.finish(req)

    def _probe_hold(self, op: str, call: Callable[[], object]) -> bool:
        try:
            call()
            return True
        except RemoteError as e:
            self._refused(e, f"the prober's {op}")
            if e.code == "expired":
                self.figures.probe_holds_expired += 1
            else:
                self.figures.probe_holds_lost += 1
                self.figures.note(f"prober's {op} refused: {e.code}: {e.message}")
            return False

    def probe_load(self, sample: list[bytes]) -> None:
        """Each key found (promoted if it was evicted) and loaded byte-exact."""
        for at in range(0, len(sample), len(PROBE_DST)):
            self._probe_chunk(sample[at:at + len(PROBE_DST)])

    def _probe_chunk(self, ks: list[bytes]) -> None:
        f = self.figures
        e = self.engine
        gpu = PROBE_DST[:len(ks)]
        self._n += 1
        req = f"probe{self._n}"
        f.probes += len(ks)
        try:
            step_until(e, lambda: e.lookup(ks, req).hits == len(ks), timeout=20.0)
        except TimeoutError:
            f.probes_unavailable += len(ks)
            f.note(f"probe unavailable: {e.lookup(ks, req, status=True)}")
            e.finish(req)
            return
        self.cluster.scramble(gpu)
        try:
            load = e.load(ks, gpu, req)
            done = e.wait([load.job_id])[load.job_id]
        except RemoteError as error:
            self._refused(error, "a probe load")
            f.note(f"probe load refused: {error}")
            return
        finally:
            e.finish(req)
        if done.success and self.cluster.holds(ks, gpu):
            f.probes_exact += len(ks)
        else:
            f.note(f"probe load wrong: {done}, exact {self.cluster.holds(ks, gpu)}")

    def check(self, final: bool = False) -> None:
        f = self.figures
        crashes = f.crashes
        super().check()  # the same broker, a stats probe in time, the engine's round trip
        if f.crashes > crashes:
            raise BrokerGone("a check found another broker, or none")
        try:
            for actor in self.actors:  # every job of every actor has its result
                if actor.jobs:
                    self._reconnect_if_stuck(actor)
            self._probe(final)
            stats = self.client.stats(verify=True)
        except (BrokerUnavailable, TimeoutError) as e:
            self._unanswered(f"in a check: {e}")
            return
        except RemoteError as e:
            self._refused(e, "the prober")
            f.probe_holds_lost += 1
            f.note(f"prober refused: {e}")
            return
        if stats["invariants"] != "ok":
            f.invariant_violations.append(stats["invariants"])
        f.fenced = stats["broker"]["peers_fenced"]
        f.peer_deaths = stats["broker"]["peer_deaths"]
        for name, pid in self.children.items():
            child = self.cluster.node.children.get(name)
            if child is None or child.pid != pid or child.proc.poll() is not None:
                self._lost_child(name)
        peers = {(p["kind"], p["pid"]) for p in stats["peers"]}
        for name, pid in self.children.items():
            kind = child_kind(name)
            if kind in ("worker", "tier") and (kind, pid) not in peers:
                f.children_changed.append(f"{name} not the broker's peer")
        if not all(p.get("kv_attached", True) for p in stats["peers"]):
            f.children_changed.append("a worker lost the engine's KV cache")

    def _lost_child(self, name: str) -> None:
        """A child of the node exited (or was replaced): the run stops, with the last
        lines of every child's log for the report."""
        f = self.figures
        child = self.cluster.node.children.get(name)
        f.children_changed.append(f"{name}: exit status {child and child.proc.poll()}")
        f.logs = {n: c.tail(40) for n, c in self.cluster.node.children.items()}
        try:
            s = self.client.stats()
            f.fenced, f.peer_deaths = s["broker"]["peers_fenced"], s["broker"]["peer_deaths"]
        except (BrokerUnavailable, RemoteError):
            pass
        raise BrokerGone(f"{name} is gone")

    def _reconnect_if_stuck(self, actor: Actor) -> None:
        try:
            done = actor.client.wait(list(actor.jobs), timeout=self.broker_cfg.job_timeout_s + 5)
        except TimeoutError as e:
            self.figures.jobs_unfinished += 1
            self.figures.note(f"jobs unfinished: {actor.name}: {e}")
            self._reconnect(actor, wait=False)
            return
        self._finished(actor, list(done.values()))

    # -- the end ------------------------------------------------------------------------

    def finish(self) -> None:
        """The last check; every client closes; once the broker has ended every owner
        but the engine and the stats client, nothing is held: no block writing, no
        lease, and every row of the CPU tier can be reserved again (no reader left);
        then every probe key is found (promoted from the memory tier) and exact."""
        f = self.figures
        self.check(final=True)
        for actor in self.actors:
            self._reconnect(actor, wait=True, again=False)
        c = self.client

        def settled() -> dict | None:
            s = c.stats()
            t = s["tiering"]
            quiet = (s["owners"]["clients"] <= 2 and s["cpu"]["blocks_writing"] == 0
                     and t["leases"] == 0 and t["cascades_in_flight"] == 0
                     and t["promotions_in_flight"] == 0 and s["transfers_in_flight"] == 0)
            return s if quiet else None

        try:
            stats = step_until(c, settled, timeout=3 * self.broker_cfg.owner_timeout_s + 10)
        except TimeoutError:
            stats = c.stats()
            f.note(f"never settled: {stats['owners']} {stats['cpu']} {stats['tiering']}")
        f.end = {"owners left": stats["owners"]["clients"] - 2,
                 "blocks writing": stats["cpu"]["blocks_writing"],
                 "leases": stats["tiering"]["leases"],
                 "invariants": c.stats(verify=True)["invariants"],
                 "rows reclaimed": self._reclaim(),
                 "of rows": self.config.cpu.num_blocks,
                 **{k: stats["owners"][k] for k in ("owners_ended", "owners_timed_out",
                                                    "reservations_aborted",
                                                    "pins_released_at_end")}}
        self.probe_load(self.probe_keys)

    def _reclaim(self) -> int:
        """Reserve every row of the CPU tier (each client its share) and abort: a row
        still written or read by anyone would be refused. The rows reserved."""
        n = self.config.cpu.num_blocks
        share = int(self.broker_cfg.owner_share * n)
        rows: set[int] = set()
        held: list[tuple[Client, list[bytes]]] = []
        try:
            for i in range(0, n, share):
                c = Client(self.config.connect_address("client"), timeout=PROBE_S)
                ks = keys(*range(i, min(n, i + share)), prefix=b"reclaim")
                r = c.reserve(ks, "reclaim")
                held.append((c, [k for k, b in zip(ks, r.block_ids, strict=True) if b >= 0]))
                rows.update(b for b in r.block_ids if b >= 0)
            for c, ks in held:
                c.commit(ks, ok=False)
        finally:
            for c, _ in held:
                c.close()
        return len(rows)

