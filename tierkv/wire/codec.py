"""The one codec of tierkv's links: message types registered by `op`, and the path
that writes them and reads (and validates) them.

Wire format: one msgpack map per ZeroMQ frame, `{"v": version, "op": name, ...}`
(`use_bin_type=True`, `raw=False`, string map keys only). Message types are
dataclasses registered by `op` (`tierkv.wire.protocol` defines them all). Decoding
validates every field against the type hints (checkers are built once per class),
so a wrong type, a missing field, an unknown op or an oversized list becomes a
`ProtocolError` naming the op and the field, never an exception deep in the
broker. Unknown extra fields are ignored: new fields are appended with defaults.

Two paths read and write the same wire. Where `msgspec` is installed (vLLM depends on
it), a message is written and read by its compiled msgpack encoder and typed decoder:
a 64-key lookup's request is packed 1.5-1.8x faster and read 1.2x faster (what is
left is the records' own checks and building the dataclasses). Whatever that path
does not take whole (a message it refuses, a free-form map whose keys only the
Python path checks, a message over `MAX_LIST` bytes) is read again by the Python
path, so a bad message gets the same `ProtocolError` either way, and a peer without
`msgspec` reads and writes the same maps (the compiled writer leaves the fields at
their default out, as the Python path does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import operator
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

import msgpack

try:
    import msgspec
except ImportError:  # optional: the Python path reads and writes the same wire
    msgspec = None  # type: ignore[assignment]

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
    if _ENCODER is not None:
        try:
            data = _encode_compiled(msg)
        except Exception:  # a value msgspec refuses: the Python path says why
            data = None
        if data is not None:
            return data
    return msgpack.packb(to_map(msg), use_bin_type=True)


def decode(data: bytes, allowed: frozenset[str] | None = None) -> Message:
    """Bytes -> message. Raises ProtocolError; never anything else."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    if _ENCODER is not None:
        msg = _decode_compiled(data, allowed)
        if msg is not None:
            msg.check()
            return msg
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


def compiled() -> bool:
    """Whether this process reads and writes the wire by msgspec."""
    return _ENCODER is not None


@contextlib.contextmanager
def python_path() -> Iterator[None]:
    """This process's codec as a peer without msgspec runs it, for the duration (what
    the benches compare the compiled path with, and the tests check it against).
    Not thread-safe: for a bench or a test, not for a running service."""
    global _ENCODER
    saved = _ENCODER
    _ENCODER = None
    try:
        yield
    finally:
        _ENCODER = saved


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


# -- the compiled path (msgspec) --------------------------------------------------------
#
# Each record dataclass has a msgspec Struct twin of the same fields and defaults
# (`_twin`), which msgspec packs without the fields at their default, as the Python
# path does, and reads without building a dict; a message's twin has its "op" (and
# "v") as fields too. Writing: the record is copied into its twin (C-level, by
# attribute: "op" is the class's), packed, and the "v" entry is put first in the map
# (its header counts it). Reading: a first pass reads "v" and "op" alone (every
# other value skipped in C), then the op's twin is read whole, typed, and copied
# into the record, which is checked as the Python path's would be (`Message.check`).
# Twins refuse fields they do not know: msgspec skips an unknown field's value
# without the checks the Python path makes of it (UTF-8, map keys), so a message
# with one (a newer peer's) is read the Python way.

_Loose = Callable[[Any], bool] | None


def _loose(tp: Any) -> _Loose:
    """Where a decoded value of type `tp` may hold what msgspec reads more loosely
    than the Python path (a free-form value: map keys that are not strings, msgpack
    extension types), a test of the value that says it does (the message is then
    read again the Python way); None where it never can."""
    if tp is Any:
        return lambda v: v is not None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [t for a in args if a is not type(None) and (t := _loose(a)) is not None]
        if not options:
            return None
        return options[0] if len(options) == 1 else (lambda v: v is not None)
    if origin in (list, tuple) or origin is dict or tp is dict:
        items = _loose(args[1] if origin is dict else args[0]) if args else _loose(Any)
        if items is None:
            return None
        test = items
        if origin is dict or tp is dict:
            return lambda v: v is not None and any(map(test, v.values()))
        return lambda v: v is not None and any(map(test, v))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = [(name, t) for name, _ in _fields(tp) if (t := _loose(hints[name])) is not None]
        if not fields:
            return None
        return lambda v: v is not None and any(t(getattr(v, name)) for name, t in fields)
    return None


def _twin(cls: type) -> type:
    """The msgspec Struct of a record dataclass: same fields, same defaults (and a
    message's "v" and "op" after them)."""
    twin = _TWINS.get(cls)
    if twin is None:
        hints = typing.get_type_hints(cls)
        spec: list[tuple[Any, ...]] = []
        for f in dataclasses.fields(cls):
            tp = _twin_type(hints[f.name])
            if f.default is not dataclasses.MISSING:
                spec.append((f.name, tp, f.default))
            elif f.default_factory is not dataclasses.MISSING:
                spec.append((f.name, tp, msgspec.field(default_factory=f.default_factory)))
            else:
                spec.append((f.name, tp))
        if issubclass(cls, Message):
            spec += [("v", int, 0), ("op", str, "")]
        twin = _TWINS[cls] = msgspec.defstruct(f"{cls.__name__}Wire", spec, omit_defaults=True,
                                               forbid_unknown_fields=True)
    return twin


def _twin_type(tp: Any) -> Any:
    """A field's type with every record dataclass in it replaced by its twin."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _twin(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_twin_type(a) for a in args)]  # noqa: UP007
    if origin in (list, tuple, dict) and args:
        return origin[tuple(a if a is Ellipsis else _twin_type(a) for a in args)]
    return tp


def _from_twin(cls: type) -> Callable[[Any], Any]:
    """What copies a twin into its record: its values in field order (C-level), the
    records among them copied in turn (a third faster than `msgspec.convert`)."""
    hints = typing.get_type_hints(cls)
    nested = [(i, copy) for i, (name, _) in enumerate(_fields(cls))
              if (copy := _copier(hints[name])) is not None]
    astuple = msgspec.structs.astuple
    count = len(_fields(cls))  # a message's twin has "v" and "op" after its fields
    if not nested:
        return lambda twin: cls(*astuple(twin)[:count])

    def copy_record(twin: Any) -> Any:
        values = list(astuple(twin)[:count])
        for i, copy in nested:
            if values[i] is not None:
                values[i] = copy(values[i])
        return cls(*values)

    return copy_record


def _copier(tp: Any) -> Callable[[Any], Any] | None:
    """What copies a decoded value of a field's type that holds twins; None: as it is."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _from_twin(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        copies = [c for a in args if a is not type(None) and (c := _copier(a)) is not None]
        return copies[0] if len(copies) == 1 and len(args) <= 2 else \
            (None if not copies else _unsupported)
    if origin in (list, tuple) and args:
        inner = _copier(args[0])
        if inner is None:
            return None
        return (lambda v: tuple(map(inner, v))) if origin is tuple else \
            (lambda v: list(map(inner, v)))
    if origin is dict and len(args) == 2 and _copier(args[1]) is not None:
        return _unsupported
    return None


def _unsupported(value: Any) -> Any:
    raise TypeError("a union of records or a map of records: read the Python way")


class _Compiled(typing.NamedTuple):
    twin: type
    decoder: Any  # msgspec.msgpack.Decoder of the twin; None: read the Python way
    to_record: Callable[[Any], Any]
    loose: _Loose
    free: tuple[str, ...]  # fields of type Any: a record in one is packed by its twin


def _compile(cls: type) -> _Compiled | None:
    """A message type's twin and decoder; None for a type msgspec cannot carry. A
    type with a free-form value at its top (a reply's `result`) is read the Python
    way every time: the compiled pass would be wasted on it."""
    hints = typing.get_type_hints(cls)
    free = tuple(name for name, _ in _fields(cls) if hints[name] is Any)
    try:
        twin = _twin(cls)
        decoder: Any = None if free else msgspec.msgpack.Decoder(twin)
    except (TypeError, ValueError):  # a field type or default msgspec does not carry
        return None
    return _Compiled(twin, decoder, _from_twin(cls), _loose(cls), free)


def _compiled(cls: type[Message]) -> _Compiled | None:
    global _PYTHON_TAILS
    compiled = _COMPILED.get(cls, _UNSEEN)
    if compiled is _UNSEEN:
        compiled = _COMPILED[cls] = _compile(cls)
        if compiled is None or compiled.decoder is None:
            # Both writers end a message's map with its "op": a message of a type
            # read the Python way is known by its last bytes, without the first pass.
            _PYTHON_TAILS = (*_PYTHON_TAILS, msgpack.packb("op") + msgpack.packb(cls.op))
    return compiled


def _decode_compiled(data: bytes, allowed: frozenset[str] | None) -> Message | None:
    """The message, read by msgspec; None where the Python path must read it (it
    then raises the ProtocolError that names what is wrong). A message of at most
    `MAX_LIST` bytes cannot hold a list or map over the limits the Python path
    checks; a longer one is left to it."""
    if len(data) > MAX_LIST or data.endswith(_PYTHON_TAILS):
        return None
    try:
        head = _ENVELOPE.decode(data)
    except Exception:  # not a map, not msgpack, a "v" or "op" of another type
        return None
    cls = _MESSAGES.get(head.op)
    if head.v != PROTOCOL_VERSION or cls is None or (allowed is not None
                                                     and head.op not in allowed):
        return None
    compiled = _compiled(cls)
    if compiled is None or compiled.decoder is None:
        return None
    try:
        msg = compiled.to_record(compiled.decoder.decode(data))
    except Exception:
        return None
    return None if compiled.loose is not None and compiled.loose(msg) else msg


def _encode_compiled(msg: Message) -> bytes | None:
    """The message packed by msgspec; None where the Python path must pack it."""
    compiled = _compiled(type(msg))
    if compiled is None:
        return None
    twin: Any = msgspec.convert(msg, compiled.twin, from_attributes=True)
    for name in compiled.free:
        value = getattr(twin, name)
        if type(value) in _PLAIN:
            continue
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            # A free-form map or list may hold records anywhere, which msgspec would
            # pack with their defaults: the Python path packs it as it always has.
            return None
        setattr(twin, name, msgspec.convert(value, _twin(type(value)), from_attributes=True))
    body = _ENCODER.encode(twin)
    first = body[0]
    if 0x80 <= first <= 0x8F:  # a fixmap: up to 15 entries
        count, start = first & 0x0F, 1
    elif first == 0xDE:  # a map16
        count, start = int.from_bytes(body[1:3], "big"), 3
    else:
        return None
    count += 1
    header = bytes((0x80 | count,)) if count <= 0x0F else b"\xde" + count.to_bytes(2, "big")
    return b"".join((header, _VERSION_ENTRY, memoryview(body)[start:]))


_COMPILED: dict[type, _Compiled | None] = {}
_TWINS: dict[type, type] = {}
_VERSION_ENTRY = msgpack.packb("v") + msgpack.packb(PROTOCOL_VERSION)
_PYTHON_TAILS: tuple[bytes, ...] = ()
if msgspec is not None:
    class _Envelope(msgspec.Struct):
        v: int = 0
        op: str = ""

    _ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
# The switch of the compiled path (`python_path` turns it off for a while).
_ENCODER: Any = msgspec.msgpack.Encoder() if msgspec is not None else None
