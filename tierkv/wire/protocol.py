"""Every message of tierkv's three links (client, gpu worker, tier), defined once.

Requests carry an `id`; replies carry the same `id`, `ok`, and `result` or
`error: {code, message}`. Block bytes never travel here; only keys, block ids and
results do. The codec that reads and writes these is `tierkv.wire.codec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tierkv.core.errors import ErrorCode
from tierkv.core.keys import MAX_KEY_LEN, OffloadEvent
from tierkv.tiers.base import Job, JobResult
from tierkv.wire.codec import (
    MAX_KEYS,
    MAX_LIST,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    BadRequest,
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
from tierkv.wire.keyblob import check_blob, key_count, unpack_counts

# A real registration is 4 deep (layout -> tensor_shapes -> shape -> dim); a layout
# of thousands of tensors has tens of thousands of values.
REGISTRATION_DEPTH = 8
REGISTRATION_NODES = 100_000

# Messages are frozen records, but for the four every round trip builds on both sides
# (`Reply`, `KeyGroups`, `OpsRequest`, `OpsResult`): a frozen `OpsResult` took 7.9 us
# to build, 1.7 us not frozen. Nothing changes a message once it is built.


# -- shared records ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    code: str
    message: str


@message("reply")
@dataclass(slots=True)  # built at every round trip: not frozen (note at the top)
class Reply(Message):
    id: int
    ok: bool
    result: Any = None
    error: ErrorInfo | None = None
    # `broker.owner_timeout_s`: the broker ends a client silent this long (what it
    # reserved aborted, its pins released), so a client pings well inside it whatever
    # it was configured with (`Client.ping_s`). 0: not said.
    owner_timeout_s: float = 0.0


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
#
# One message (`ops`) carries every operation of one engine step, in sections that
# run in a fixed order: commit, release, contexts, lookup, pin, load, reserve, store,
# touch, queue, finish, then step (or poll) and wait. Reads are protected before
# anything allocates (pin and load before reserve and store, which may evict), and a
# request's leases end only after its own loads of the same step (finish last). The
# keys of every section travel in one blob (`tierkv.wire.keyblob`), section after
# section in that order; each section's groups (one per request) take `counts[i]`
# keys from it. Results come back as arrays, one item per group or per key of each
# section.


@dataclass(slots=True)  # built at every round trip: not frozen (note at the top)
class KeyGroups:
    """Groups of keys, one per request: `counts` (int32 little endian) keys each,
    taken in order from the message's key blob; `req_ids` one per group (or none)."""

    counts: bytes
    req_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the engine or its orchestrator says about a request (advice: a wrong or
    missing hint never costs correctness). `tiers`: the secondary tiers this request
    may be served from (None: all)."""

    req_id: str
    tiers: list[str] | None = None
    session: str = ""  # the conversation (or agent session) the request belongs to
    turn: int = -1
    continues: bool | None = None  # will the session come back for another turn?
    next_turn_s: float | None = None  # expected seconds until it does (or a ttl)
    hints: dict[str, Any] | None = None  # opaque orchestrator hints (vLLM's kv_hints)
    # The longest this request should wait for promotions from the secondary tiers
    # (what recomputing them would take, where the engine knows it better than a
    # rate): a load expected to take longer is not started, one that overruns ends.
    load_budget_s: float | None = None

    def check(self, where: str = "contexts") -> None:
        if self.hints is not None:
            check_tree(self.hints, f"{where}.hints", 8, 10_000)
        if self.turn < -1:
            raise BadRequest(f"{where}.turn: must be >= 0 (or -1: unknown), got {self.turn}")
        if self.next_turn_s is not None and not 0 <= self.next_turn_s < math.inf:
            raise BadRequest(f"{where}.next_turn_s: must be a finite number >= 0, got "
                                f"{self.next_turn_s}")
        if self.load_budget_s is not None and not 0 <= self.load_budget_s < math.inf:
            raise BadRequest(f"{where}.load_budget_s: must be a finite number >= 0, got "
                             f"{self.load_budget_s}")


# Sections with keys, in the order they run and take their keys from the blob.
KEY_SECTIONS = ("commit", "commit_as", "release", "lookup", "pin", "load", "reserve", "store",
                "touch", "queue")
# Arrays that go with a section: (field, bytes per item, one per key (else per group)).
_PER_ITEM = {"commit": ("commit_ok", 1, False), "store": ("store_gpu", 4, True),
             "load": ("load_gpu", 4, True)}


@message("ops")
@dataclass(slots=True)  # built at every round trip: not frozen (note at the top)
class OpsRequest(Message):
    """Every operation of one engine step (see the section comment above)."""

    id: int
    keys: bytes = b""
    key_len: int = 0  # the width of every key; 0: `key_lens` has one byte per key
    key_lens: bytes = b""
    commit: KeyGroups | None = None  # reserved blocks are written (or not: commit_ok)
    commit_ok: bytes = b""  # uint8 per commit group
    # Reserved blocks written as the blocks of other keys: per group, n reserved keys
    # then the n keys their rows now hold (a block present already is not stored twice).
    commit_as: KeyGroups | None = None
    release: KeyGroups | None = None  # pinned blocks were read
    finish: list[str] = field(default_factory=list)  # requests done: leases end
    contexts: list[RequestContext] = field(default_factory=list)
    lookup: KeyGroups | None = None
    lookup_status: bool = False  # also a status per key (hit, pending, miss, retry)
    lookup_pin: bool = False  # also pin every hit for its request (its block id in `rows`)
    pin: KeyGroups | None = None  # protect ready blocks the engine reads (its ids back)
    reserve: KeyGroups | None = None  # allocate blocks the engine writes (ids back)
    touch: KeyGroups | None = None
    store: KeyGroups | None = None  # the worker path: GPU -> CPU tier, every rank
    store_gpu: bytes = b""  # int32 per store key: its GPU block
    load: KeyGroups | None = None  # the worker path: CPU tier -> GPU
    load_gpu: bytes = b""  # int32 per load key
    queue: KeyGroups | None = None  # prefix keys of requests waiting in the engine
    step: bool = False  # end the engine step: apply completions, flush jobs
    poll: bool = False  # collect finished jobs and events without ending a step
    wait: list[int] = field(default_factory=list)  # answer once these jobs finished...
    wait_s: float = 0.0  # ...or this long passed
    # Tokens of KV registrations (by rank) this client may `store`/`load` with although
    # another client made them (`Client.use_kv`); its own need none.
    kv_tokens: list[str] = field(default_factory=list)
    # uint8 per lookup group: 1 its keys each on their own with a status (sliding-window
    # layers), 0 a leading run (full attention: promotions stop at its first miss).
    # Empty: `lookup_status` for every group.
    lookup_modes: bytes = b""
    # The CPU region (`SharedRegion.generation`) the engine wrote the rows it commits
    # into: a commit into another region than the broker's is refused `stale_region`.
    # Empty: not said (the worker path, which the broker's own region serves).
    region: str = ""
    # What recomputing costs this engine, for the load-or-recompute rule
    # (`tierkv.core.costs`): its prefill rate in tokens/s and the tokens one key
    # covers. 0: not said (the broker's `prefill_tokens_per_s`, or every load goes).
    prefill_tps: float = 0.0
    key_tokens: int = 0
    # The prefix every key of this client's starts with (an engine's namespace; empty:
    # every key): the reply's `arrivals` counts the keys that came under it.
    scope: bytes = b""

    def check(self) -> None:
        for name, values, limit in (("contexts", self.contexts, MAX_CONTEXTS),
                                    ("finish", self.finish, MAX_FINISH),
                                    ("wait", self.wait, MAX_WAIT),
                                    ("kv_tokens", self.kv_tokens, 64)):
            if len(values) > limit:
                raise BadRequest(f"ops.{name}: {len(values)} items exceeds the limit "
                                 f"of {limit}")
        if not 0 <= self.prefill_tps < math.inf:
            raise BadRequest(f"ops.prefill_tps: must be a finite number >= 0, got "
                             f"{self.prefill_tps}")
        if not 0 <= self.key_tokens <= MAX_KEY_TOKENS:
            raise BadRequest(f"ops.key_tokens: must be 0..{MAX_KEY_TOKENS}, got "
                             f"{self.key_tokens}")
        if len(self.scope) > MAX_KEY_LEN:
            raise BadRequest(f"ops.scope: {len(self.scope)} bytes exceeds the limit of "
                             f"{MAX_KEY_LEN} (a key's)")
        if len(self.region) > MAX_REGION_LEN:  # a generation is "pid.start time"
            raise BadRequest(f"ops.region: {len(self.region)} characters exceeds the limit "
                             f"of {MAX_REGION_LEN}")
        for i, context in enumerate(self.contexts):
            context.check(f"ops.contexts[{i}]")
        check_blob(self.keys, self.key_len, self.key_lens, "ops.keys")
        n = key_count(self.keys, self.key_len, self.key_lens)
        if n > MAX_STEP_KEYS:
            raise BadRequest(f"ops: {n} keys exceeds the limit of {MAX_STEP_KEYS}")
        taken = 0
        for name in KEY_SECTIONS:
            groups: KeyGroups | None = getattr(self, name)
            if groups is None:
                continue
            limit = MAX_QUEUE_CHAINS if name == "queue" else MAX_GROUPS
            if len(groups.counts) > 4 * limit:
                raise BadRequest(f"ops.{name}: {len(groups.counts) // 4} groups exceeds "
                                    f"the limit of {limit}")
            counts = unpack_counts(groups.counts, f"ops.{name}.counts")
            if groups.req_ids and len(groups.req_ids) != len(counts):
                raise ProtocolError(f"ops.{name}: {len(groups.req_ids)} req_ids for "
                                    f"{len(counts)} groups")
            total = sum(counts)
            taken += total
            extra = _PER_ITEM.get(name)
            if extra is not None:
                field_name, size, per_key = extra
                items = total if per_key else len(counts)
                if len(getattr(self, field_name)) != size * items:
                    raise ProtocolError(f"ops.{field_name}: {len(getattr(self, field_name))} "
                                        f"bytes for {items} items")
        if taken != n:
            raise ProtocolError(f"ops: the sections take {taken} keys, the blob has {n}")
        if self.lookup_modes:
            lookups = len(self.lookup.counts) // 4 if self.lookup is not None else 0
            if len(self.lookup_modes) != lookups or max(self.lookup_modes) > 1:
                raise BadRequest(f"ops.lookup_modes: {len(self.lookup_modes)} bytes of 0 or 1 "
                                 f"wanted, one per lookup group ({lookups})")
        if not 0 <= self.wait_s <= 3600:
            raise ProtocolError(f"ops.wait_s: {self.wait_s} is not 0..3600")


@dataclass(frozen=True, slots=True)
class OpError:
    """One group of a section that failed; the others ran."""

    section: str
    index: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class TransferResult:
    """A store or load the client asked for has finished on every rank."""

    job_id: int
    kind: str  # "store" | "load"
    success: bool
    error_code: str = ""
    error: str = ""


def lost_job(job_id: int, why: str) -> TransferResult:
    """The result of a job a restarted broker cannot answer for: failed, for its
    transfer may not have finished (its bytes must not be read)."""
    return TransferResult(job_id, "unknown", False, ErrorCode.UNAVAILABLE.value, why)


@dataclass(slots=True)  # built at every round trip: not frozen (note at the top)
class OpsResult:
    """The answers of an `ops` request: arrays, one item per group or per key."""

    hits: bytes = b""  # int32 per lookup group: leading keys ready in the CPU tier
    state: bytes = b""  # uint8 per lookup group: 0 answered, 1 pending, 2 retry
    status: bytes = b""  # uint8 per lookup key, if asked: see LOOKUP_STATUSES
    sources: bytes = b""  # uint8 per lookup key, if asked: 0 CPU (or not a hit), 1 + tier
    tiers: list[str] = field(default_factory=list)  # the tiers `sources` counts from 1
    rows: bytes = b""  # int32 per lookup key, if pinned: its CPU block id (-1: not a hit)
    pinned: bytes = b""  # int32 per pin key: its CPU block id (-1: not pinned)
    reserved: bytes = b""  # int32 per reserve key: the CPU block to write (-1: nothing to)
    reserve_ok: bytes = b""  # uint8 per reserve group: 0 no room now (nothing reserved)
    stored_as: bytes = b""  # uint8 per commit_as pair: 1 the key's block is the one written
    evicted: bytes = b""  # the keys reserves evicted (a key blob with `evicted_lens`)
    evicted_lens: bytes = b""
    store_jobs: bytes = b""  # int64 per store group: the job id, -1 none
    store_refused: bytes = b""  # uint8 per store group
    store_accepted: bytes = b""  # uint8 per store key
    load_jobs: bytes = b""  # int64 per load group: the job id, -1 failed
    load_sources: list[dict[str, int]] = field(default_factory=list)
    errors: list[OpError] = field(default_factory=list)
    finished: list[TransferResult] = field(default_factory=list)
    events: list[OffloadEvent] = field(default_factory=list)
    step: int = 0
    # The CPU region the block ids above name (`SharedRegion.generation`), in every
    # reply: a broker restarted on the same instance makes a new one, and block ids,
    # job ids and results of the old are void (a client drops what it held of them).
    region: str = ""
    # How long the pins this reply took are held unless released or taken again
    # (`broker.pin_s`; 0: it took none): a client may keep a hit that long without
    # asking again, counting from before it sent the request.
    pin_s: float = 0.0
    # int32 per lookup group and tier of `tiers` (group-major), when any lookup skipped
    # one: leading keys held in that tier that were not promoted, because loading them
    # was expected to take longer than recomputing them.
    slower: bytes = b""
    # With `events`: keys of this client's events the broker dropped since its last
    # step or poll (its queue holds `broker.events.MAX_QUEUED_KEYS` keys, the oldest
    # go first): the engine's view of the tiers has that many holes.
    events_dropped: int = 0
    # In every reply: a count of the keys under the request's `scope` the node came
    # to hold other than by this client's own stores (another client's, found in a
    # tier), one a reconnected client never saw before; or -1 when a tier cannot
    # tell (a shared one without a listing). See `broker.arrivals`.
    # A key under it this client was told is a miss, and has not stored since, is
    # still a miss while this has not moved and `region` is the same.
    arrivals: int = -1


LOOKUP_STATUSES = ("miss", "hit", "pending", "retry")
# What one `ops` message may ask, so that no single message stalls the broker's loop
# past its heartbeat budget (a lookup of 131,072 keys takes well under 0.2 s): over
# a limit, the message is refused before any work (`bad_request`, naming it).
MAX_STEP_KEYS = 1 << 17  # keys in the blob
MAX_REGION_LEN = 64  # `OpsRequest.region`: a `SharedRegion.generation`
MAX_KEY_TOKENS = 1 << 20  # `OpsRequest.key_tokens`
MAX_GROUPS = 1 << 14  # groups in one section (requests of one step)
MAX_CONTEXTS = 1 << 12  # request contexts
MAX_QUEUE_CHAINS = 1 << 12  # waiting requests in the `queue` section
MAX_FINISH = 1 << 14  # finished requests
MAX_WAIT = 1 << 12  # jobs waited for


@message("stats")
@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    id: int
    verify: bool = False  # also check the block-state invariants (O(blocks): tests, debug)


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


@message("events")
@dataclass(frozen=True, slots=True)
class EventBatch(Message):
    """Broker -> subscribers of `broker.events_address` (PUB), once per step with
    events: every stored/removed event of the node, in order. `seq` counts batches,
    so a subscriber sees what it missed."""

    seq: int
    step: int
    events: list[OffloadEvent]


# What each end of each link accepts (`decode`'s `allowed`).
CLIENT_OPS = frozenset({"ops", "stats", "kv_register", "hb", "bye"})
WORKER_OPS = frozenset({"worker_hello", "transfer_done", "kv_attached", "hb", "bye"})
TIER_OPS = frozenset({"tier_hello", "inventory", "ready", "tier_done", "tier_stats", "hb", "bye"})
TO_WORKER_OPS = frozenset({"welcome", "refused", "transfer", "kv_attach", "kv_detach", "hb",
                           "bye"})
TO_TIER_OPS = frozenset({"welcome", "refused", "tier_jobs", "hb", "bye"})


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
    # The token of `registration` (see `AttachKV.token`).
    registration_token: str = ""

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
    # What proves the right to this registration (`Client.use_kv`); the worker keeps
    # it with the registration and names it again in its hello after a broker restart.
    token: str = ""


@message("kv_detach")
@dataclass(frozen=True, slots=True)
class DetachKV(Message):
    """Broker -> worker: the registration with this token ended (its client closed or
    was ended), so the worker lets go of the engine's memory (shm mapping, CUDA IPC
    handles) once the transfers in flight on it are done. Another token: ignored (a
    newer registration replaced it)."""

    token: str


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
    # A shared tier that lists what other nodes store this often (0: it does not):
    # keys it has not reported are misses, not existence checks.
    refresh_s: float = 0.0


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
