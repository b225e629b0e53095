"""One TOML file configures a whole node; defaults make a working single node.

Every section is a dataclass whose fields carry their meaning; loading checks every
key against it, so an unknown key, a wrong type, a missing required value or an
impossible size is one `ConfigError` naming the key and the file. Each `[[tiers]]`
entry is checked the same way against its type's own options, found through the
tier registry (`tierkv.tiers.registry.check_tier_entry`): nothing is created and
nothing is contacted. `tierkv config --explain` prints every key
(`tierkv.node.reference`).

    instance = "node0"
    namespace = "llama3-8b/bf16/l32"
    [cpu]
    num_blocks = 4096
    page_size = 262144
    [[tiers]]
    type = "disk"
    root = "/var/cache/tierkv"
    budget_bytes = 100_000_000_000
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.core.policies import known_policies
from tierkv.core.shm import MAX_INSTANCE_LEN
from tierkv.core.units import format_bytes  # re-exported: callers import it from here
from tierkv.node.realtime import check_priority
from tierkv.tiers.registry import TierOptionError, check_tier_entry
from tierkv.wire.sockets import CurveClientKeys, is_loopback


class ConfigError(ValueError):
    """A bad config value; the message names the file and the key."""


def doc(default: Any, text: str) -> Any:
    """A field with its meaning attached: `tierkv config --explain` prints it."""
    return field(default=default, metadata={"doc": text})


@dataclass
class CpuConfig:
    """The CPU tier: one shared-memory region of fixed-size blocks."""

    num_blocks: int = doc(1024, "blocks in the CPU tier")
    page_size: int = doc(256 * 1024, "bytes of one block of one rank, all layers, K and V: "
                         "the engine layout's page_size")
    world_size: int = doc(1, "tensor-parallel ranks: one gpu worker each, one page each "
                          "per block")
    policy: str = doc("hitdensity", "the eviction policy (see `known` below)")
    reuse_threshold: int = doc(0, "0: store every block; n: only after n lookups of it")
    cascade_backlog_blocks: int = doc(0, "keys waiting to be cascaded to one secondary tier, "
                                      "at most; past it new blocks skip that tier rather than "
                                      "pin the CPU tier. 0: a quarter of num_blocks, >= 64")
    prefault: bool = doc(True, "allocate the whole region at start (about 1.5 s per GiB, "
                         "and 0.1 s per GiB for each worker and tier process to map it) "
                         "rather than on the first stores, which then run ten times slower")


@dataclass
class BrokerConfig:
    """The broker: its sockets, its clock and its deadlines."""

    client_address: str = doc("", "where engines connect; empty: an ipc socket in the run "
                              "directory (owner-only); tcp beyond loopback needs CurveZMQ")
    worker_address: str = doc("", "where gpu workers connect (empty: ipc in the run directory)")
    tier_address: str = doc("", "where tier processes connect (empty: ipc in the run "
                            "directory)")
    tick_ms: float = doc(5.0, "a step when no client has stepped for this long")
    lease_s: float = doc(10.0, "a block a lookup reported as a hit (or promoted) to a "
                         "request stays there for it this long after the request last "
                         "asked, unless it loads it or finishes")
    heartbeat_s: float = doc(0.5, "heartbeat interval; a peer silent for 3 is dead")
    job_timeout_s: float = doc(30.0, "deadline of one transfer or tier job")
    drain_timeout_s: float = doc(10.0, "how long a stopping broker waits for jobs in flight")
    metrics_port: int = doc(0, "Prometheus metrics on 127.0.0.1:<port>; 0: off")
    events_address: str = doc("", "a PUB socket with every stored/removed event of the "
                              "node, for routers (each client gets the events of its own "
                              "blocks in `step`); empty: off")
    curve_secret_file: str = doc("", "CurveZMQ: the broker's secret key file (`tierkv "
                                 "keygen`); required for a tcp address beyond loopback")
    curve_authorized_dir: str = doc("", "CurveZMQ: a directory of the public keys let in")
    owner_timeout_s: float = doc(30.0, "a client silent this long is gone: its reservations "
                                 "are aborted, its pins, leases and KV registrations released "
                                 "(the client library pings while idle)")
    reservation_s: float = doc(60.0, "a reserved block not committed by then is withdrawn (a "
                               "miss for every lookup); reserving it again renews it")
    pin_s: float = doc(300.0, "a pinned block not released by then is released; pinning it "
                       "again renews it")
    owner_share: float = doc(0.5, "the share of cpu.num_blocks one client may hold reserved "
                             "and pinned at once (0..1]")
    realtime_priority: int = doc(0, "SCHED_RR priority (1..99) of the broker's threads, so "
                                 "that its answers do not wait behind a busy host's other "
                                 "work; needs CAP_SYS_NICE or `ulimit -r` of at least it "
                                 "(else a warning and normal scheduling); 0: normal")
    tier_secret_file: str = doc("", "the secret a tier process started outside the supervisor "
                                "proves in its hello (mode 0600); empty: tier.secret in the "
                                "run directory, made by the broker")


@dataclass
class WorkerConfig:
    """The gpu workers, one per rank."""

    device: str = doc("auto", "auto | cpu | cuda: where the engine's KV cache lives")
    enabled: bool = doc(True, "false: start no gpu workers; engines that copy their own "
                        "blocks (tierkv.vllm) need none")


@dataclass
class GpuConfig:
    """CUDA workers."""

    allow_unpinned: bool = doc(False, "run CUDA copies from a CPU tier that could not be "
                               "pinned (cudaHostRegister failed): synchronous and slow")


@dataclass
class ClientConfig:
    """Clients of the broker: engines, and the workers and tiers themselves."""

    timeout_s: float = doc(10.0, "every client call waits at most this long")
    realtime_priority: int = doc(0, "SCHED_RR priority (1..99) of a thread while it waits for "
                                 "the broker's answer (only then); with the broker's own, "
                                 "keeps the round trip's tail short on a busy host; 0: off")
    curve_secret_file: str = doc("", "CurveZMQ: this side's secret key file")
    curve_server_public_file: str = doc("", "CurveZMQ: the broker's public key file (both "
                                        "are needed when the broker has curve on)")

    def curve_keys(self) -> CurveClientKeys | None:
        if not self.curve_secret_file:
            return None
        return CurveClientKeys(self.curve_secret_file, self.curve_server_public_file)


@dataclass
class SupervisorConfig:
    """`tierkv up`: starting, restarting, probing and logging the node's processes."""

    ready_timeout_s: float = doc(60.0, "how long a process may take to say it is ready")
    stop_timeout_s: float = doc(20.0, "how long a stopping process may take before SIGKILL")
    restart_backoff_s: float = doc(0.5, "first delay before restarting a process that died")
    restart_backoff_max_s: float = doc(10.0, "the delay doubles while it keeps dying, up to "
                                       "this")
    log_lines: int = doc(40, "recent lines of each process kept for error reports")
    broker_probe_s: float = doc(5.0, "interval and timeout of the `stats` probe of the broker; "
                                "0: no probes")
    broker_probe_misses: int = doc(3, "a broker that answered once and then misses this many "
                                   "probes in a row is hung: killed and restarted")
    log_file_bytes: int = doc(16 * 2**20, "the node's log (node.log in the run directory: "
                              "the supervisor's lines and every process's) rotates at this "
                              "size")
    log_file_count: int = doc(4, "log files kept (node.log, node.log.1, ...): the log never "
                              "takes more than log_file_count x log_file_bytes")


@dataclass
class Config:
    """The node: one TOML file, every section optional."""

    instance: str = doc("tierkv", "the node's name: its shared memory is /tierkv.<instance>."
                        "cpu; one node per instance on a machine")
    namespace: str = doc("default", "model, dtype, layout: two models never read each other's "
                         "blocks from a shared tier")
    run_dir: str = doc("", "sockets, node.toml, supervisor.json and node.log; default "
                       "$XDG_RUNTIME_DIR/tierkv/<instance> or /tmp/tierkv-<uid>/tierkv/<instance>")
    log_level: str = doc("info", "debug | info | warning | error")
    cpu: CpuConfig = field(default_factory=CpuConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    tiers: list[dict[str, Any]] = field(
        default_factory=list, metadata={"doc": "secondary tiers, fastest first: [[tiers]] "
                                        "entries (see the tier types below)"})
    source: str = field(default="<defaults>", compare=False)  # the file it came from

    # -- derived ----------------------------------------------------------------

    @property
    def run_path(self) -> Path:
        if self.run_dir:
            return Path(self.run_dir)
        base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/tierkv-{os.getuid()}"
        return Path(base) / "tierkv" / self.instance

    def address(self, link: str) -> str:
        """The address the broker binds for `link` (client, worker, tier)."""
        explicit = getattr(self.broker, f"{link}_address")
        return explicit or f"ipc://{self.run_path / (link + '.sock')}"

    def connect_address(self, link: str) -> str:
        """The address a peer on this host connects to: a wildcard bind (all
        interfaces) is reached through loopback."""
        address = self.address(link)
        for wildcard, loopback in (("tcp://0.0.0.0:", "tcp://127.0.0.1:"),
                                   ("tcp://*:", "tcp://127.0.0.1:"),
                                   ("tcp://[::]:", "tcp://[::1]:")):
            if address.startswith(wildcard):
                return loopback + address[len(wildcard):]
        return address

    @property
    def tier_secret_path(self) -> Path:
        """The file whose secret a tier process started by hand proves in its hello."""
        return Path(self.broker.tier_secret_file or self.run_path / "tier.secret")

    @property
    def tier_names(self) -> list[str]:
        return [tier_name(t) for t in self.tiers]

    def tier(self, name: str) -> dict[str, Any]:
        for entry in self.tiers:
            if tier_name(entry) == name:
                return entry
        raise ConfigError(f"{self.source}: no tier named {name!r} (tiers: {self.tier_names})")


def tier_name(entry: dict[str, Any]) -> str:
    return str(entry.get("name") or entry.get("type"))


# -- loading -------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str] | None = None, *, starting: bool = True,
                **overrides: Any) -> Config:
    """Read and validate a config file (None: the defaults). `starting=False` skips
    the checks of this machine that only starting a node needs (the size of
    /dev/shm): `tierkv down` and `status` only need the addresses, and must reach a
    running node even where a fresh start would be refused."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {source} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{source}: not valid TOML ({e})") from None
    data.update(overrides)
    return config_from_dict(data, source, starting=starting)


def config_from_dict(data: dict[str, Any], source: str = "<dict>", *,
                     starting: bool = True) -> Config:
    config = _build(Config, data, source, "")
    config.source = source
    _check(config, starting)
    return config


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: [{prefix.rstrip('.')}] must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(names))})"
        )
    kwargs = {}
    for name in names & set(data):
        kwargs[name] = _value(hints[name], data[name], source, prefix + name)
    return cls(**kwargs)


def _value(tp: Any, value: Any, source: str, key: str) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, source, key + ".")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be a list, got {_kind(value)}")
        (item,) = typing.get_args(tp)
        return [_value(item, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a table, got {_kind(value)}")
        return dict(value)
    if tp is float and type(value) in (int, float):
        return float(value)
    if type(value) is not tp:
        raise ConfigError(f"{source}: {key} must be {tp.__name__}, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def _check(c: Config, starting: bool = True) -> None:
    src = c.source

    def fail(key: str, why: str) -> None:
        raise ConfigError(f"{src}: {key} {why}")

    # Counted in bytes of UTF-8, as the shared-memory name is (tierkv.core.shm), so a
    # name `up` would refuse is refused here first.
    if (not c.instance or "/" in c.instance or "\x00" in c.instance
            or len(c.instance.encode()) > MAX_INSTANCE_LEN):
        fail("instance", f"must be 1..{MAX_INSTANCE_LEN} bytes of UTF-8 without '/', got "
             f"{c.instance!r} ({len(c.instance.encode())} bytes)")
    for key in ("num_blocks", "page_size", "world_size"):
        if getattr(c.cpu, key) <= 0:
            fail(f"cpu.{key}", f"must be positive, got {getattr(c.cpu, key)}")
    if c.cpu.reuse_threshold < 0:
        fail("cpu.reuse_threshold", "must be >= 0")
    if c.cpu.cascade_backlog_blocks < 0:
        fail("cpu.cascade_backlog_blocks", "must be >= 0")
    if c.cpu.policy not in known_policies():
        fail("cpu.policy", f"is {c.cpu.policy!r}; known: {', '.join(known_policies())}")
    size = c.cpu.num_blocks * c.cpu.page_size * c.cpu.world_size
    limit = _shm_capacity() if starting else None
    if limit is not None and size > limit:
        fail(
            "cpu.num_blocks",
            f"x page_size x world_size = {format_bytes(size)} of shared memory, "
            f"more than this machine has ({format_bytes(limit)} in /dev/shm)",
        )
    for key in ("tick_ms", "heartbeat_s", "job_timeout_s", "drain_timeout_s", "lease_s",
                "owner_timeout_s", "reservation_s", "pin_s"):
        if getattr(c.broker, key) <= 0:
            fail(f"broker.{key}", "must be positive")
    if not 0 < c.broker.owner_share <= 1:
        fail("broker.owner_share", f"must be in (0, 1], got {c.broker.owner_share}")
    if c.broker.events_address and not c.broker.events_address.startswith(("ipc://", "tcp://")):
        fail("broker.events_address", f"must be an ipc:// or tcp:// address, got "
             f"{c.broker.events_address!r}")
    if not 0 <= c.broker.metrics_port < 65536:
        fail("broker.metrics_port", "must be 0..65535")
    if c.worker.device not in ("auto", "cpu", "cuda"):
        fail("worker.device", f"must be auto, cpu or cuda, got {c.worker.device!r}")
    if c.client.timeout_s <= 0:
        fail("client.timeout_s", "must be positive")
    for side in ("broker", "client"):
        why = check_priority(getattr(c, side).realtime_priority)
        if why is not None:
            fail(f"{side}.realtime_priority", why)
    if c.supervisor.broker_probe_s < 0:
        fail("supervisor.broker_probe_s", "must be >= 0 (0: no probes)")
    if c.supervisor.broker_probe_misses < 1:
        fail("supervisor.broker_probe_misses", "must be >= 1")
    if bool(c.broker.curve_secret_file) != bool(c.broker.curve_authorized_dir):
        fail("broker.curve_secret_file", "and broker.curve_authorized_dir go together")
    for key in ("client_address", "worker_address", "tier_address", "events_address"):
        address = getattr(c.broker, key)
        if address and not c.broker.curve_secret_file and not is_loopback(address):
            # Refused here, before anything starts, not by the broker once it has
            # created the node's shared memory.
            fail(f"broker.{key}", f"= {address!r} is reachable beyond loopback: set "
                 f"broker.curve_secret_file and broker.curve_authorized_dir (CurveZMQ keys: "
                 f"`tierkv keygen`), or bind to 127.0.0.1, ::1 or ipc://")
    if bool(c.client.curve_secret_file) != bool(c.client.curve_server_public_file):
        fail("client.curve_secret_file", "and client.curve_server_public_file go together")
    if c.log_level.lower() not in ("debug", "info", "warning", "error"):
        fail("log_level", f"must be debug, info, warning or error, got {c.log_level!r}")
    if c.supervisor.log_file_bytes < 4096:
        fail("supervisor.log_file_bytes", f"must be >= 4096, got {c.supervisor.log_file_bytes}")
    if c.supervisor.log_file_count < 2:
        fail("supervisor.log_file_count", "must be >= 2 (the file being written and one "
             f"rotated), got {c.supervisor.log_file_count}")
    seen = set()
    for i, entry in enumerate(c.tiers):
        if "type" not in entry:
            fail(f"tiers[{i}]", "has no 'type'")
        try:
            check_tier_entry(entry)
        except TierOptionError as e:
            fail(f"tiers[{i}].{e.key}", e.why)
        why = _check_budget(entry, c.cpu.page_size * c.cpu.world_size)
        if why is not None:
            fail(f"tiers[{i}].budget_bytes", why)
        name = tier_name(entry)
        if name in seen:
            fail(f"tiers[{i}].name", f"{name!r} is used twice")
        seen.add(name)


INT64_MAX = 2**63 - 1


def _check_budget(entry: dict[str, Any], block_bytes: int) -> str | None:
    """Why a tier's `budget_bytes` can never work, or None: it travels as a msgpack
    int64 and must hold one block (a disk slot: the block plus its header), which the
    tier's own options cannot tell without the CPU tier's page size; checked here so
    that `tierkv config` refuses what the tier process would die on."""
    if "budget_bytes" not in entry:
        return None
    budget = entry["budget_bytes"]
    if type(budget) is not int:
        return f"must be an integer number of bytes, got {_kind(budget)}"
    if budget > INT64_MAX:
        return f"must be at most {INT64_MAX} (int64), got {budget}"
    if budget == 0 and entry.get("type") != "disk":
        return None  # 0: unbounded, where the tier type allows it
    least = block_bytes
    if entry.get("type") == "disk":
        from workers.disk.layout import slot_bytes_for

        least = slot_bytes_for(block_bytes)
    if budget < least:
        return (f"must hold at least one block ({least} bytes = {format_bytes(least)}, "
                f"from cpu.page_size x cpu.world_size), got {budget}")
    return None


def check_tiers_here(c: Config) -> None:
    """The tier checks that need this machine (a disk root exists, a credentials
    variable is set): run by whoever starts the tier processes, before it starts
    anything; not at every load, since a config is also read elsewhere."""
    for i, entry in enumerate(c.tiers):
        try:
            check_tier_entry(entry, local=True)
        except TierOptionError as e:
            raise ConfigError(f"{c.source}: tiers[{i}].{e.key} {e.why}") from None


def _shm_capacity() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


# -- writing -------------------------------------------------------------------------


def dump_config(config: Config) -> str:
    """The config as TOML (children of a supervisor read the file it writes)."""
    lines: list[str] = []
    tables: list[tuple[str, Any]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "source":
            continue
        if dataclasses.is_dataclass(value):
            tables.append((f.name, value))
        elif f.name == "tiers":
            continue
        else:
            lines.append(f"{f.name} = {_toml(value)}")
    for name, table in tables:
        lines.append(f"\n[{name}]")
        for f in dataclasses.fields(table):
            lines.append(f"{f.name} = {_toml(getattr(table, f.name))}")
    for entry in config.tiers:
        lines.append("\n[[tiers]]")
        lines.extend(f"{k} = {_toml(v)}" for k, v in entry.items())
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"cannot write {type(value).__name__} to TOML")
