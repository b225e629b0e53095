"""The one codec of tierkv's links: message types registered by `op`, and the path
that writes them and reads (and validates) them.

Wire format: one msgpack map per ZeroMQ frame, `{"v": version, "op": name, ...}`
(`use_bin_type=True`, `raw=False`, string map keys only). Message types are
dataclasses registered by `op` (`tierkv.wire.protocol` defines them all). Decoding
validates every field against the type hints (checkers are built once per class),
so a wrong type, a missing field, an unknown op or an oversized list becomes a
`ProtocolError` naming the op and the field, never an exception deep in the
broker. Unknown extra fields are ignored: new fields are appended with defaults.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import msgpack

from tierkv.core.errors import ErrorCode
from tierkv.core.loglimit import foreign

PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 64 << 20
MAX_LIST = 1 << 18  # items in any one list field
MAX_KEYS = 1 << 16  # keys in one client request


class ProtocolError(ValueError):
    """A message that does not follow the protocol."""

    code = ErrorCode.PROTOCOL


class BadRequest(ProtocolError):
    """A well-formed message asking for something not allowed (a value out of range,
    a limit passed): refused whole, before any of it is applied."""

    code = ErrorCode.BAD_REQUEST


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
        raise ProtocolError(f"not a msgpack message ({type(e).__name__}: {foreign(str(e))})") from e
    return decode_map(obj, allowed)


def decode_map(obj: Any, allowed: frozenset[str] | None = None) -> Message:
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a map, got {type(obj).__name__}")
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        older = type(version) is int and 0 < version < PROTOCOL_VERSION
        raise ProtocolError(
            f"protocol version {foreign(repr(version), 40)}, this side speaks version "
            f"{PROTOCOL_VERSION}" + (": upgrade the other side's tierkv" if older else "")
        )
    op = obj.get("op")
    cls = _MESSAGES.get(op) if isinstance(op, str) else None
    if cls is None or (allowed is not None and op not in allowed):
        raise ProtocolError(f"unknown op {foreign(repr(op), 40)}")
    msg = _from_wire(cls, obj, str(op))
    msg.check()
    return msg


def check_tree(value: Any, where: str, max_depth: int, max_nodes: int) -> None:
    """Free-form maps (a registration, a tier's stats) are bounded before anything
    walks them recursively: nested deeper than `max_depth` or holding more than
    `max_nodes` values is a ProtocolError (checked iteratively)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ProtocolError(f"{where}: more than {max_nodes} values")
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise ProtocolError(f"{where}: nested deeper than {max_depth}")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                   else item))


def peek_id(data: bytes) -> int | None:
    """The request id of a message that failed to decode, for the error reply. Only
    the top map's keys are read and every other value skipped unread: a message
    refused for a list over a limit still gets its reply under its own id (its client
    skips a reply under another id as stale, and would wait out its timeout)."""
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_array_len=64,
                                    max_map_len=64, max_str_len=64, max_bin_len=64)
        unpacker.feed(data)
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "id":
                request_id = unpacker.unpack()
                return request_id if type(request_id) is int else None
            unpacker.skip()
    except Exception:
        return None
    return None


def to_record(cls: type[T], obj: Any, where: str = "") -> T:
    """Decode a map into a record dataclass (reply results), validating it."""
    return _from_wire(cls, obj, where or cls.__name__)


T = TypeVar("T")


_SCALARS = (bytes, int, str, float, bool, type(None))
# Per record type: (field, default) pairs; fields at their default are not sent
# (the other side fills them in), which keeps an engine step's message small.
_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {}
_REQUIRED: dict[type, frozenset[str]] = {}


def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    fields = _FIELDS.get(cls)
    if fields is None:
        pairs = []
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = _NO_DEFAULT
            pairs.append((f.name, default))
        fields = _FIELDS[cls] = tuple(pairs)
    return fields


# Values that go on the wire as they are (exact types: an enum member is not one).
_PLAIN = frozenset(_SCALARS)
# Per type met: a record type's getter of every field's value at once (C-level),
# with the names and defaults `_fields` gives; None for any other type.
_Getter = tuple[Callable[[Any], tuple[Any, ...]], tuple[str, ...], tuple[Any, ...]]
_GETTERS: dict[type, _Getter | None] = {}
_UNSEEN: Any = object()


def _getter(cls: type) -> _Getter:
    fields = _fields(cls)
    names = tuple(name for name, _ in fields)
    get = operator.attrgetter(*names) if len(names) > 1 else \
        (lambda value: (getattr(value, names[0]),)) if names else (lambda value: ())
    return get, names, tuple(default for _, default in fields)


def _to_wire(value: Any) -> Any:
    kind = type(value)
    if kind in _PLAIN:
        return value
    getter = _GETTERS.get(kind, _UNSEEN)
    if getter is _UNSEEN:  # a type met for the first time: a record type or not
        getter = _GETTERS[kind] = _getter(kind) if dataclasses.is_dataclass(kind) else None
    if getter is not None:  # a record: the fields not at their default
        get, names, defaults = getter
        out = {}
        for name, default, v in zip(names, defaults, get(value), strict=True):
            if default is _NO_DEFAULT or not (v is default or v == default):
                out[name] = v if type(v) in _PLAIN else _to_wire(v)
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        # Lists are homogeneous (typed fields): a list of scalars goes as it is.
        if not value or type(value[0]) in _PLAIN:
            return value if kind is list else list(value)
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value  # a scalar of a subclass (not an enum), or what msgpack refuses


def _from_wire(cls: type[T], obj: Any, where: str) -> T:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(obj).__name__}")
    checkers = _checkers(cls)
    kwargs = {}
    # A checker is told the field's name alone; where the record sits is added to
    # its error here (not formatted for every field of every message read).
    try:
        if len(obj) <= len(checkers) + 2:  # the fields given (most are at their default)
            for name, value in obj.items():
                entry = checkers.get(name)
                if entry is not None:
                    kwargs[name] = entry[0](value, name)
        else:  # a map of many unknown keys: walk the known fields instead
            for name, (check, _) in checkers.items():
                if name in obj:
                    kwargs[name] = check(obj[name], name)
    except ProtocolError as e:
        raise ProtocolError(f"{where}.{e}") from None
    required = _REQUIRED[cls]
    if required and not kwargs.keys() >= required:
        raise ProtocolError(f"{where}: missing field {min(required - kwargs.keys())!r}")
    return cls(**kwargs)


def _checkers(cls: type) -> dict[str, tuple[Checker, Any]]:
    checkers = _CHECKERS.get(cls)
    if checkers is None:
        hints = typing.get_type_hints(cls)
        checkers = {name: (_checker(hints[name]), default) for name, default in _fields(cls)}
        _REQUIRED[cls] = frozenset(n for n, (_, d) in checkers.items() if d is _NO_DEFAULT)
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
                raise ProtocolError(f"{where}: {foreign(repr(v), 40)} is not one of {choices}")
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
                raise ProtocolError(
                    f"{where}: {foreign(repr(v), 40)} is not a valid {tp.__name__}") from None

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
