"""One TOML file configures a whole node; defaults make a working single node.

Every section is a dataclass; loading checks every key against it, so an unknown
key, a wrong type, a missing required value or an impossible size is one
`ConfigError` naming the key and the file. Tier entries are checked against their
backend's constructor when the tier is created (`tierkv.tiers.registry`).

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
from tierkv.wire.sockets import CurveClientKeys


class ConfigError(ValueError):
    """A bad config value; the message names the file and the key."""


@dataclass
class CpuConfig:
    num_blocks: int = 1024
    page_size: int = 256 * 1024  # bytes of one block of one rank (all layers, K and V)
    world_size: int = 1
    policy: str = "lru"
    reuse_threshold: int = 0  # 0: store every block; n: only after n lookups
    # Keys waiting to be cascaded to one secondary tier, at most; past it new blocks
    # skip that tier rather than pin the CPU tier. 0: a quarter of num_blocks, >= 64.
    cascade_backlog_blocks: int = 0
    # Allocate the whole region at start (about 1.5 s per GiB here) rather than
    # on the first stores, which otherwise run ten times slower.
    prefault: bool = True


@dataclass
class BrokerConfig:
    # Empty: ipc sockets in the run directory (owner-only).
    client_address: str = ""
    worker_address: str = ""
    tier_address: str = ""
    tick_ms: float = 5.0  # a step when no client has stepped for this long
    # A block a lookup reported as a hit (or promoted) to a request stays there for
    # it this long after the request last asked, unless it loads it or finishes.
    lease_s: float = 10.0
    heartbeat_s: float = 0.5  # a peer silent for 3 intervals is dead
    job_timeout_s: float = 30.0  # deadline of one transfer or tier job
    drain_timeout_s: float = 10.0  # how long SIGTERM waits for in-flight jobs
    metrics_port: int = 0  # Prometheus metrics on 127.0.0.1; 0: off
    # A PUB socket with every stored/removed event of the node, for routers (each
    # client gets the events of its own blocks in `step`); "": off.
    events_address: str = ""
    # CurveZMQ (required for a tcp address beyond loopback): the broker's secret key
    # file and a directory of the public keys it lets in (see `tierkv keygen`).
    curve_secret_file: str = ""
    curve_authorized_dir: str = ""


@dataclass
class WorkerConfig:
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class GpuConfig:
    allow_unpinned: bool = False  # run CUDA copies from an unpinned CPU tier (synchronous, slow)


@dataclass
class ClientConfig:
    timeout_s: float = 10.0  # every client call waits at most this long
    # CurveZMQ for clients, workers and tiers: their own secret key file and the
    # broker's public key file (both needed when the broker has curve on).
    curve_secret_file: str = ""
    curve_server_public_file: str = ""

    def curve_keys(self) -> CurveClientKeys | None:
        if not self.curve_secret_file:
            return None
        return CurveClientKeys(self.curve_secret_file, self.curve_server_public_file)


@dataclass
class SupervisorConfig:
    ready_timeout_s: float = 60.0
    stop_timeout_s: float = 20.0
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 10.0
    log_lines: int = 40  # recent lines of each child kept for error reports
    # A broker that answered once and then misses this many `stats` probes in a row
    # (each waits broker_probe_s) is hung: killed and restarted. 0 turns probes off.
    broker_probe_s: float = 5.0
    broker_probe_misses: int = 3


@dataclass
class Config:
    instance: str = "tierkv"
    namespace: str = "default"
    run_dir: str = ""  # default: $XDG_RUNTIME_DIR/tierkv/<instance> or /tmp/tierkv-<uid>/...
    log_level: str = "info"
    cpu: CpuConfig = field(default_factory=CpuConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    tiers: list[dict[str, Any]] = field(default_factory=list)
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


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Config:
    """Read and validate a config file (None: the defaults)."""
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
    return config_from_dict(data, source)


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    config = _build(Config, data, source, "")
    config.source = source
    _check(config)
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


def _check(c: Config) -> None:
    src = c.source

    def fail(key: str, why: str) -> None:
        raise ConfigError(f"{src}: {key} {why}")

    if not c.instance or "/" in c.instance or len(c.instance) > 48:
        fail("instance", f"must be 1..48 characters without '/', got {c.instance!r}")
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
    limit = _shm_capacity()
    if limit is not None and size > limit:
        fail(
            "cpu.num_blocks",
            f"x page_size x world_size = {size / 2**30:.1f} GiB of shared memory, "
            f"more than this machine has ({limit / 2**30:.1f} GiB in /dev/shm)",
        )
    for key in ("tick_ms", "heartbeat_s", "job_timeout_s", "drain_timeout_s", "lease_s"):
        if getattr(c.broker, key) <= 0:
            fail(f"broker.{key}", "must be positive")
    if c.broker.events_address and not c.broker.events_address.startswith(("ipc://", "tcp://")):
        fail("broker.events_address", f"must be an ipc:// or tcp:// address, got "
             f"{c.broker.events_address!r}")
    if not 0 <= c.broker.metrics_port < 65536:
        fail("broker.metrics_port", "must be 0..65535")
    if c.worker.device not in ("auto", "cpu", "cuda"):
        fail("worker.device", f"must be auto, cpu or cuda, got {c.worker.device!r}")
    if c.client.timeout_s <= 0:
        fail("client.timeout_s", "must be positive")
    if c.supervisor.broker_probe_s < 0:
        fail("supervisor.broker_probe_s", "must be >= 0 (0: no probes)")
    if c.supervisor.broker_probe_misses < 1:
        fail("supervisor.broker_probe_misses", "must be >= 1")
    if bool(c.broker.curve_secret_file) != bool(c.broker.curve_authorized_dir):
        fail("broker.curve_secret_file", "and broker.curve_authorized_dir go together")
    if bool(c.client.curve_secret_file) != bool(c.client.curve_server_public_file):
        fail("client.curve_secret_file", "and client.curve_server_public_file go together")
    if c.log_level.lower() not in ("debug", "info", "warning", "error"):
        fail("log_level", f"must be debug, info, warning or error, got {c.log_level!r}")
    seen = set()
    for i, entry in enumerate(c.tiers):
        if "type" not in entry:
            fail(f"tiers[{i}]", "has no 'type'")
        name = tier_name(entry)
        if name in seen:
            fail(f"tiers[{i}].name", f"{name!r} is used twice")
        seen.add(name)
        processes = entry.get("processes", 1)
        if type(processes) is not int or processes < 1:
            fail(f"tiers[{i}].processes", f"must be a positive integer, got {processes!r}")


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
