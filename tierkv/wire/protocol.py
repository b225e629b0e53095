"""Every message of tierkv's three links (client, gpu worker, tier), defined once.

Requests carry an `id`; replies carry the same `id`, `ok`, and `result` or
`error: {code, message}`. Block bytes never travel here; only keys, block ids and
results do. The codec that reads and writes these is `tierkv.wire.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierkv.core.keys import MAX_KEY_LEN, OffloadEvent
from tierkv.tiers.base import Job, JobResult
from tierkv.wire.codec import (
    MAX_KEYS,
    MAX_LIST,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    check_tree,
    decode,
    decode_map,
    encode,
    message,
    peek_id,
    to_map,
    to_record,
)


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


# A real registration is 4 deep (layout -> tensor_shapes -> shape -> dim); a layout
# of thousands of tensors has tens of thousands of values.
REGISTRATION_DEPTH = 8
REGISTRATION_NODES = 100_000


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
    # The token a registration of this rank returned: lets another client (the
    # same engine after a reconnect) replace it. See `broker.registrations`.
    token: str = ""

    def check(self) -> None:
        check_tree(self.registration, "kv_register.registration", REGISTRATION_DEPTH,
                   REGISTRATION_NODES)


BATCHABLE_OPS = frozenset({"lookup", "store", "load", "touch", "finish", "step", "poll"})
# What each end of each link accepts (`decode`'s `allowed`).
CLIENT_OPS = BATCHABLE_OPS | {"stats", "batch", "kv_register"}
WORKER_OPS = frozenset({"worker_hello", "transfer_done", "kv_attached", "hb", "bye"})
TIER_OPS = frozenset({"tier_hello", "inventory", "ready", "tier_done", "tier_stats", "hb", "bye"})
TO_WORKER_OPS = frozenset({"welcome", "refused", "transfer", "kv_attach", "hb", "bye"})
TO_TIER_OPS = frozenset({"welcome", "refused", "tier_jobs", "hb", "bye"})


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
    # Of the loaded keys, how many a promotion brought from each secondary tier
    # (counted once per promoted block, at its first load); the rest were CPU hits.
    sources: dict[str, int] = field(default_factory=dict)


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


@message("events")
@dataclass(frozen=True, slots=True)
class EventBatch(Message):
    """Broker -> subscribers of `broker.events_address` (PUB), once per step with
    events: every stored/removed event of the node, in order. `seq` counts batches,
    so a subscriber sees what it missed."""

    seq: int
    step: int
    events: list[OffloadEvent]


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
    # CUDA workers: whether the CPU tier is pinned for DMA (None: a CPU worker).
    pinned: bool | None = None
    # The token the supervisor gave this process: what lets the broker fence it.
    token: str = ""

    def check(self) -> None:
        if self.registration is not None:
            check_tree(self.registration, "worker_hello.registration", REGISTRATION_DEPTH,
                       REGISTRATION_NODES)


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
    token: str = ""  # the token the supervisor gave this process (see WorkerHello)


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

    def check(self) -> None:
        check_tree(self.stats, "tier_stats.stats", 4, 1000)


@message("tier_done")
@dataclass(frozen=True, slots=True)
class TierDoneBatch(Message):
    results: list[JobResult]
    credit: int = 0  # credit returned with the results


__all__ = ["MAX_KEYS", "MAX_LIST", "MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "Message",
           "ProtocolError", "decode", "decode_map", "encode", "message", "peek_id", "to_map",
           "to_record"]
