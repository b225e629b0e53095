"""Every message of tierkv's three links, and the one codec that reads and writes them.

Wire format: one msgpack map per ZeroMQ frame, `{"v": version, "op": name, ...}`
(`use_bin_type=True`, `raw=False`, string map keys only). Requests carry an `id`;
replies carry the same `id`, `ok`, and `result` or `error: {code, message}`.

Message types are frozen dataclasses registered by `op`. Decoding validates every
field against the type hints (checkers are built once per class), so a wrong
type, a missing field, an unknown op or an oversized list becomes a
`ProtocolError` naming the op and the field, never an exception deep in the
broker. Unknown extra fields are ignored: new fields are appended with defaults.
Block bytes never travel here; only keys, block ids and results do.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

from tierkv.errors import ErrorCode
from tierkv.keys import MAX_KEY_LEN, OffloadEvent
from tierkv.tiers.base import Job, JobResult

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20
MAX_LIST = 1 << 18  # items in any one list field
MAX_KEYS = 1 << 16  # keys in one client request


class ProtocolError(ValueError):
    """A message that does not follow the protocol."""

    code = ErrorCode.PROTOCOL


# -- the codec -----------------------------------------------------------------------

Checker = Callable[[Any, str], Any]
_MESSAGES: dict[str, type[Message]] = {}
_CHECKERS: dict[type, dict[str, tuple[Checker, Any]]] = {}
_NO_DEFAULT = object()


class Message:
    """Base of all message types; `op` names it on the wire."""

    op: ClassVar[str] = ""

    def check(self) -> None:
        """Constraints beyond the field types (overridden where needed)."""


M = TypeVar("M", bound=type)


def message(op: str) -> Callable[[M], M]:
    def register(cls: M) -> M:
        if op in _MESSAGES:
            raise ValueError(f"op {op!r} defined twice")
        cls.op = op  # type: ignore[attr-defined]
        _MESSAGES[op] = cls
        return cls

    return register


def to_map(msg: Message) -> dict[str, Any]:
    """The wire map of a message (what `encode` packs; batches carry these)."""
    body: dict[str, Any] = _to_wire(msg)
    body["v"] = PROTOCOL_VERSION
    body["op"] = msg.op
    return body


def encode(msg: Message) -> bytes:
    return msgpack.packb(to_map(msg), use_bin_type=True)


def decode(data: bytes, allowed: frozenset[str] | None = None) -> Message:
    """Bytes -> message. Raises ProtocolError; never anything else."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES,
            max_str_len=MAX_MESSAGE_BYTES, max_array_len=MAX_LIST, max_map_len=MAX_LIST,
        )
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"not a msgpack message ({type(e).__name__}: {e})") from e
    return decode_map(obj, allowed)


def decode_map(obj: Any, allowed: frozenset[str] | None = None) -> Message:
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a map, got {type(obj).__name__}")
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r}, this side speaks version {PROTOCOL_VERSION}"
        )
    op = obj.get("op")
    cls = _MESSAGES.get(op) if isinstance(op, str) else None
    if cls is None or (allowed is not None and op not in allowed):
        raise ProtocolError(f"unknown op {op!r}")
    msg = _from_wire(cls, obj, str(op))
    msg.check()
    return msg


def peek_id(data: bytes) -> int | None:
    """The request id of a message that failed to decode, for the error reply."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=MAX_LIST)
        request_id = obj.get("id") if isinstance(obj, dict) else None
        return request_id if type(request_id) is int else None
    except Exception:
        return None


def to_record(cls: type[T], obj: Any, where: str = "") -> T:
    """Decode a map into a record dataclass (reply results), validating it."""
    return _from_wire(cls, obj, where or cls.__name__)


T = TypeVar("T")


_SCALARS = (bytes, int, str, float, bool, type(None))
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _to_wire(value: Any) -> Any:
    if isinstance(value, _SCALARS):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, (list, tuple)):
        # Lists are homogeneous (typed fields): a list of scalars goes as it is.
        if not value or isinstance(value[0], _SCALARS) and not isinstance(value[0], enum.Enum):
            return value if type(value) is list else list(value)
        return [_to_wire(v) for v in value]
    names = _FIELD_NAMES.get(type(value))
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[type(value)] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        return {name: _to_wire(getattr(value, name)) for name in names}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _from_wire(cls: type[T], obj: Any, where: str) -> T:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(obj).__name__}")
    kwargs = {}
    for name, (check, default) in _checkers(cls).items():
        if name in obj:
            kwargs[name] = check(obj[name], f"{where}.{name}")
        elif default is _NO_DEFAULT:
            raise ProtocolError(f"{where}: missing field {name!r}")
    return cls(**kwargs)


def _checkers(cls: type) -> dict[str, tuple[Checker, Any]]:
    checkers = _CHECKERS.get(cls)
    if checkers is None:
        hints = typing.get_type_hints(cls)
        checkers = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory
            else:
                default = _NO_DEFAULT
            checkers[f.name] = (_checker(hints[f.name]), default)
        _CHECKERS[cls] = checkers
    return checkers


def _checker(tp: Any) -> Checker:  # noqa: C901 - one branch per supported type
    origin = typing.get_origin(tp)
    if tp is Any:
        return lambda v, where: v
    if origin is typing.Literal:
        choices = typing.get_args(tp)

        def check_literal(v: Any, where: str) -> Any:
            if v not in choices or type(v) is not type(choices[0]):
                raise ProtocolError(f"{where}: {v!r} is not one of {choices}")
            return v

        return check_literal
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _checker(options[0]) if len(options) == 1 else _checker(Any)
        return lambda v, where: None if v is None else inner(v, where)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        item = _checker(args[0]) if args else _checker(Any)
        make = tuple if origin is tuple else list
        exact = _EXACT.get(args[0]) if args else None

        def check_list(v: Any, where: str) -> Any:
            if type(v) is not list:
                raise ProtocolError(f"{where}: expected a list, got {type(v).__name__}")
            if len(v) > MAX_LIST:
                raise ProtocolError(f"{where}: {len(v)} items exceeds {MAX_LIST}")
            if exact is not None:  # fast path for lists of plain scalars (C-level loops)
                if v and set(map(type, v)) != {exact}:
                    bad = next(x for x in v if type(x) is not exact)
                    raise ProtocolError(
                        f"{where}: expected {exact.__name__} items, got {type(bad).__name__}"
                    )
                return v if make is list else tuple(v)
            return make(item(x, f"{where}[{i}]") for i, x in enumerate(v))

        return check_list
    if origin is dict:
        def check_dict(v: Any, where: str) -> Any:
            if type(v) is not dict:
                raise ProtocolError(f"{where}: expected a map, got {type(v).__name__}")
            return v

        return check_dict
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        def check_enum(v: Any, where: str) -> Any:
            try:
                return tp(v)
            except ValueError:
                raise ProtocolError(f"{where}: {v!r} is not a valid {tp.__name__}") from None

        return check_enum
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return lambda v, where: _from_wire(tp, v, where)
    if tp is float:
        def check_float(v: Any, where: str) -> float:
            if type(v) not in (float, int):
                raise ProtocolError(f"{where}: expected a number, got {type(v).__name__}")
            return float(v)

        return check_float
    exact = _EXACT.get(tp)
    if exact is None:
        raise TypeError(f"protocol cannot carry fields of type {tp!r}")

    def check_exact(v: Any, where: str) -> Any:
        if type(v) is not exact:
            raise ProtocolError(
                f"{where}: expected {exact.__name__}, got {type(v).__name__}"
            )
        return v

    return check_exact


_EXACT: dict[Any, type] = {int: int, str: str, bytes: bytes, bool: bool}


def _check_keys(keys: list[bytes] | tuple[bytes, ...], where: str) -> None:
    if len(keys) > MAX_KEYS:
        raise ProtocolError(f"{where}: {len(keys)} keys exceeds {MAX_KEYS}")
    if keys:
        lengths = list(map(len, keys))
        shortest, longest = min(lengths), max(lengths)
        if shortest < 1 or longest > MAX_KEY_LEN:
            bad = shortest if shortest < 1 else longest
            raise ProtocolError(f"{where}: a key must be 1..{MAX_KEY_LEN} bytes, got {bad}")


def _check_co_indexed(msg: Any) -> None:
    _check_keys(msg.keys, f"{msg.op}.keys")
    if len(msg.keys) != len(msg.gpu_block_ids):
        raise ProtocolError(
            f"{msg.op}: {len(msg.keys)} keys but {len(msg.gpu_block_ids)} gpu_block_ids"
        )
    if any(b < 0 for b in msg.gpu_block_ids):
        raise ProtocolError(f"{msg.op}: negative gpu block id")


# -- shared records ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    code: str
    message: str


@message("reply")
@dataclass(frozen=True, slots=True)
class Reply(Message):
    id: int
    ok: bool
    result: Any = None
    error: ErrorInfo | None = None


@message("hb")
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Either direction, any link. Any message counts as a heartbeat; this one is
    sent only when a side has had nothing else to say for an interval."""


@message("welcome")
@dataclass(frozen=True, slots=True)
class Welcome(Message):
    instance: str
    num_blocks: int
    page_size: int
    world_size: int
    heartbeat_s: float
    namespace: str = ""


@message("refused")
@dataclass(frozen=True, slots=True)
class Refused(Message):
    reason: str


@message("bye")
@dataclass(frozen=True, slots=True)
class Bye(Message):
    """A clean goodbye: the peer is stopping, fail nothing, expect nothing."""

    reason: str = ""


# -- client <-> broker -----------------------------------------------------------------


@message("lookup")
@dataclass(frozen=True, slots=True)
class LookupRequest(Message):
    id: int
    keys: list[bytes]
    req_id: str | None = None

    def check(self) -> None:
        _check_keys(self.keys, "lookup.keys")


@message("store")
@dataclass(frozen=True, slots=True)
class StoreRequest(Message):
    id: int
    keys: list[bytes]
    gpu_block_ids: list[int]
    req_id: str | None = None

    def check(self) -> None:
        _check_co_indexed(self)


@message("load")
@dataclass(frozen=True, slots=True)
class LoadRequest(Message):
    id: int
    keys: list[bytes]
    gpu_block_ids: list[int]
    req_id: str | None = None

    def check(self) -> None:
        _check_co_indexed(self)


@message("touch")
@dataclass(frozen=True, slots=True)
class TouchRequest(Message):
    id: int
    keys: list[bytes]

    def check(self) -> None:
        _check_keys(self.keys, "touch.keys")


@message("finish")
@dataclass(frozen=True, slots=True)
class FinishRequest(Message):
    id: int
    req_id: str


@message("step")
@dataclass(frozen=True, slots=True)
class StepRequest(Message):
    """End the engine step: apply completions, then reply with what finished."""

    id: int


@message("poll")
@dataclass(frozen=True, slots=True)
class PollRequest(Message):
    """Collect finished jobs and events without ending a step."""

    id: int


@message("stats")
@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    id: int
    verify: bool = False  # also check the block-state invariants (O(blocks): tests, debug)


@message("batch")
@dataclass(frozen=True, slots=True)
class BatchRequest(Message):
    """Many operations of one engine step in one round trip, run in order."""

    id: int
    ops: list[dict[str, Any]]


@message("kv_register")
@dataclass(frozen=True, slots=True)
class RegisterKVRequest(Message):
    """From an engine GPU process: its KV cache, for the worker of `rank`."""

    id: int
    rank: int
    registration: dict[str, Any]


BATCHABLE_OPS = frozenset({"lookup", "store", "load", "touch", "finish", "step", "poll"})
CLIENT_OPS = BATCHABLE_OPS | {"stats", "batch", "kv_register"}


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: int
    pending: bool


@dataclass(frozen=True, slots=True)
class StoreResult:
    job_id: int | None  # None when no key needed storing, or the store was refused
    keys_accepted: list[bytes]
    refused: bool = False  # no room could be made (blocks busy): try again later


@dataclass(frozen=True, slots=True)
class LoadResult:
    job_id: int


@dataclass(frozen=True, slots=True)
class TransferResult:
    """A store or load the client asked for has finished on every rank."""

    job_id: int
    kind: str  # "store" | "load"
    success: bool
    error_code: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class StepResult:
    finished: list[TransferResult]
    events: list[OffloadEvent]
    step: int = 0


@dataclass(frozen=True, slots=True)
class BatchResult:
    results: list[Reply]


# -- broker <-> gpu worker --------------------------------------------------------------


@message("worker_hello")
@dataclass(frozen=True, slots=True)
class WorkerHello(Message):
    rank: int
    world_size: int
    pid: int
    start_time: int = 0
    device: str = "cpu"
    # The engine registration this worker already has attached (it survives a
    # broker restart), so the broker can re-attach it to a future worker.
    registration: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class TransferJob:
    job_id: int
    direction: str  # "store": device -> CPU tier; "load": CPU tier -> device
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    deadline: float = 0.0  # CLOCK_MONOTONIC seconds; 0 = none


@message("transfer")
@dataclass(frozen=True, slots=True)
class TransferBatch(Message):
    jobs: list[TransferJob]


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    job_id: int
    success: bool
    error_code: str = ""
    error: str = ""
    bytes_moved: int = 0
    seconds: float = 0.0


@message("transfer_done")
@dataclass(frozen=True, slots=True)
class TransferDoneBatch(Message):
    results: list[TransferOutcome]


@message("kv_attach")
@dataclass(frozen=True, slots=True)
class AttachKV(Message):
    """Broker -> worker: the engine's registration, to open and check."""

    reg_id: int
    registration: dict[str, Any]


@message("kv_attached")
@dataclass(frozen=True, slots=True)
class AttachedKV(Message):
    reg_id: int
    ok: bool
    error: str = ""
    page_size: int = 0


# -- broker <-> tier process ------------------------------------------------------------


@message("tier_hello")
@dataclass(frozen=True, slots=True)
class TierHello(Message):
    tier: str  # the configured tier name this process serves
    type: str
    pid: int
    start_time: int = 0
    shared: bool = False
    capacity_bytes: int | None = None
    namespace: str = ""
    inventory_total: int = 0  # keys that follow in Inventory messages


@message("inventory")
@dataclass(frozen=True, slots=True)
class Inventory(Message):
    keys: list[bytes]
    last: bool


@message("ready")
@dataclass(frozen=True, slots=True)
class Ready(Message):
    credit: int  # how many more jobs the tier process can take


@message("tier_jobs")
@dataclass(frozen=True, slots=True)
class TierJobBatch(Message):
    jobs: list[Job]
    deadlines: list[float] = field(default_factory=list)  # co-indexed, CLOCK_MONOTONIC


@message("tier_stats")
@dataclass(frozen=True, slots=True)
class TierStats(Message):
    """The backend's own figures (blocks, bytes, breaker state), about once a second."""

    stats: dict[str, Any]


@message("tier_done")
@dataclass(frozen=True, slots=True)
class TierDoneBatch(Message):
    results: list[JobResult]
    credit: int = 0  # credit returned with the results
