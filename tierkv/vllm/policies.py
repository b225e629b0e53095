"""tierkv's eviction policies as vLLM 0.33 cache policies, with no tierkv process.

vLLM's CPU offloading (`CPUOffloadingSpec` and the tiering spec's CPU tier) build a
`CPUOffloadingManager`, which asks `CachePolicyFactory` for its policy class: a
built-in name ("lru", "arc"), or any class of a module given as
`cache_policy_module_path`, found with `getattr(module, eviction_policy)`. So::

    kv_connector_extra_config = {
        "eviction_policy": "TierkvHistARC",
        "cache_policy_module_path": "tierkv.vllm.policies",
    }

runs tierkv's histarc inside vLLM. `TierkvLRU`, `TierkvARC` and `TierkvHistARC` are
written out; any other policy in tierkv's registry (`tierkv.core.policies`) is
reachable as `Tierkv<Name>` (case and `_`/`-` ignored), made on first use by the
module's `__getattr__`, so a policy registered later plugs in with no code here.

Why an adapter and not a port: the policy is tierkv's own, and it sees exactly
three events, as in `tierkv replay` and in the broker: a use (`touch`, in order, the
last key the most recent), a stored block (`insert`, after the eviction that made
room for it) and `evict(n, protected)`, all or nothing. `TierkvPolicy` turns vLLM's
calls into those events and nothing else:

* a prefix is used and stored **tail first**, so its head is the most recent of its
  blocks and the last to go: a prefix lookup stops at the first miss, so a chain
  without its head is worth nothing while its head alone still saves work (vLLM's
  own LRU ranks tails before heads the same way). A request's inserts are handed to
  the tierkv policy in one batch, tail first, before its next decision;
* a use is a request's first access to a resident, ready chunk: one it loads, or
  one it offers again for a store (vLLM offers a GPU-cached prefix again for every
  request that shares it; that is the prefix being used, as vLLM's LRU counts it);
* `insert` happens in `prepare_store`. Until the store completes the chunk is
  protected from eviction and ignored by `touch`;
* `on_store_miss` and `on_request_finished` change nothing: tierkv's ARCs learn
  from ghost hits in `insert`, and the request's uses were taken when they happened
  (taking them again at the end would count a reuse twice);
* readers and unfinished stores are read from each chunk's `ref_cnt` at eviction
  time, so `mark_evictable`/`mark_non_evictable` need no bookkeeping.

`tests/vllm/test_policies.py` holds the adapter's decisions, request by request, to
tierkv's `PrimaryTier` given the same events, and its hit ratios to vLLM's LRU.

All methods run on the scheduler thread that drives the manager, under its lock.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

try:
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as VllmCachePolicy
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus, order_request_keys
except ImportError as e:  # vLLM absent, or not the 0.33 API these classes implement
    raise ImportError(
        f"tierkv.vllm.policies needs vLLM 0.33 ({e}); install it with: "
        "pip install 'tierkv[vllm]'"
    ) from e

from tierkv.core.policies import CachePolicy, known_policies, make_policy
from tierkv.core.policies.hints import hints_from_kv_hints
from tierkv.vllm.request_keys import request_keys, require_request_keys

#: The prefix of every policy class name this module offers.
CLASS_PREFIX = "Tierkv"

__all__ = [
    "CLASS_PREFIX",
    "TierkvARC",
    "TierkvHistARC",
    "TierkvLRU",
    "TierkvPolicy",
    "class_name",
    "policy_class",
    "policy_class_names",
]


class _Unevictable:
    """`protected` as tierkv's evict sees it: vLLM's protected keys, the uses of
    requests not handed over yet (`_Request`), and chunks that are being read
    (ref_cnt > 0) or still being written (ref_cnt -1)."""

    __slots__ = ("chunks", "protected", "used")

    def __init__(self, protected: set[OffloadKey], used: set[OffloadKey],
                 chunks: dict[OffloadKey, ChunkStatus]):
        self.protected = protected
        self.used = used
        self.chunks = chunks

    def __contains__(self, key: object) -> bool:
        if key in self.protected or key in self.used:
            return True
        chunk = self.chunks.get(key)  # type: ignore[call-overload]
        return chunk is not None and chunk.ref_cnt != 0


@dataclass(slots=True)
class _Request:
    """A request's events the tierkv policy has not seen yet: its stores, then its
    uses (both head first), handed over tail first once it stored or finished."""

    inserts: list[OffloadKey] = field(default_factory=list)
    uses: dict[OffloadKey, None] = field(default_factory=dict)


class TierkvPolicy(VllmCachePolicy):
    """A vLLM `CachePolicy` that delegates every decision to a tierkv policy.

    Subclasses name the tierkv policy in `policy_name`; vLLM builds them with
    `cls(cache_capacity=num_chunks)`. The tierkv policy holds every chunk from its
    hand-over to its eviction or removal, with the `ChunkStatus` as its value, so an
    eviction hands vLLM back the very chunk objects it inserted.

    Why a hand-over: vLLM pins and uses a request's hits, then evicts for its store,
    then inserts the store's chunks head first. For the request's head to end the
    most recent, the tierkv policy must see the stored tail first and the hits after
    it; the hits are kept from eviction meanwhile (`_Unevictable`). So a request's
    events wait in a `_Request` until it stored (handed over at the next decision),
    another request stores, or it finished.
    """

    policy_name: ClassVar[str]
    # Seconds on a monotonic clock, for policies that learn from time (hitdensity);
    # a replay sets the trace's own clock here.
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, cache_capacity: int) -> None:
        if not hasattr(self, "policy_name"):  # eviction_policy named the base class
            raise TypeError(f"{type(self).__name__} is the adapter's base class; "
                            f"name one of {', '.join(policy_class_names())}")
        # The policy is told each request's whole chain, from vLLM's record of it.
        require_request_keys(f"tierkv's {type(self).__name__}",
                             "use one of vLLM's own eviction policies")
        super().__init__(cache_capacity)
        # Every chunk vLLM inserted and did not get back, ready or not: `get` must
        # answer for chunks still being written too (vLLM's HIT_PENDING).
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self._policy: CachePolicy = make_policy(self.policy_name, cache_capacity)
        self._noted: set[str] = set()  # requests the policy was told of, until they end
        self._requests: dict[str, _Request] = {}  # events not handed over, by request
        self._current: str | None = None  # the request that accessed chunks last

    @property
    def tierkv_policy(self) -> CachePolicy:
        """The tierkv policy making the decisions (for stats and tests)."""
        self._hand_over(list(self._requests))
        return self._policy

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus,
               req_context: ReqContext | None = None) -> None:
        # vLLM 0.32 calls insert(key, chunk): such chunks wait under no request's id,
        # handed over at the next decision like any request's.
        self._chunks[key] = chunk
        pending = (self._request(req_context) if req_context is not None
                   else self._requests.setdefault("", _Request()))
        pending.inserts.append(key)

    def remove(self, key: OffloadKey) -> None:
        """Forget a chunk whose store failed; unknown keys are ignored, as in tierkv."""
        if self._chunks.pop(key, None) is None:
            return
        for pending in self._requests.values():
            if key in pending.inserts:
                pending.inserts.remove(key)
                return
        self._policy.remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """An explicit use of `keys`: as `on_request_access` takes uses."""
        self._use(order_request_keys([list(keys)], req_context), req_context)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Not a use: the base class would touch; tierkv learns from the insert."""
        return

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """A request's first access to `keys`: the resident, ready ones are its uses
        (it loads them, or offers them again for a store). Keys it is about to
        store are not resident yet."""
        ordered = order_request_keys([list(keys)], req_context)
        # The request's whole chain and hints, before its uses (as `tierkv replay`
        # tells the policy); a policy that does not use them ignores them.
        if req_context.req_id not in self._noted:
            self._noted.add(req_context.req_id)
            chain = order_request_keys([list(_known_keys(req_context) or ordered)],
                                       req_context)
            self._policy.note_request(req_context.req_id, chain,
                                      hints_from_kv_hints(req_context.kv_hints), self.clock())
        self._use(ordered, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """The request's end: what it stored and used is handed over."""
        self._hand_over([req_context.req_id])
        self._noted.discard(req_context.req_id)
        self._policy.note_finish(req_context.req_id, self.clock())

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Exactly `n` idle chunks not in `protected`, or None and no change."""
        if n <= 0:
            return []
        # vLLM reports a store's chunks as accessed just before it evicts for them, so
        # the request that accessed last is the one storing: its uses stay protected.
        self._hand_over([r for r, pending in self._requests.items()
                         if pending.inserts or r != self._current])
        used = {k for pending in self._requests.values() for k in pending.uses}
        victims: list[tuple[OffloadKey, ChunkStatus]] | None = self._policy.evict(
            n, _Unevictable(protected, used, self._chunks)
        )
        if victims is None:
            return None
        for key, _ in victims:
            del self._chunks[key]
        return victims

    def clear(self) -> None:
        """Drop every chunk and start a fresh tierkv policy: ghosts and the
        adaptive target go too, as vLLM's contract asks."""
        self._chunks.clear()
        self._noted.clear()
        self._requests.clear()
        self._current = None
        self._policy = make_policy(self.policy_name, self.cache_capacity)

    def _request(self, req_context: ReqContext) -> _Request:
        pending = self._requests.get(req_context.req_id)
        if pending is None:
            pending = self._requests[req_context.req_id] = _Request()
        return pending

    def _use(self, head_first: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """The ready chunks of `head_first` are used by the request (a chunk still
        being written is not a use: the tierkv policy does not hold it yet)."""
        self._current = req_context.req_id
        chunks = self._chunks
        ready = [k for k in head_first if (c := chunks.get(k)) is not None and c.is_ready]
        if ready:
            self._request(req_context).uses.update(dict.fromkeys(ready))

    def _hand_over(self, req_ids: Iterable[str]) -> None:
        """Each request's stores, then its uses, tail first: its head ends the most
        recent. tierkv's ARCs admit a returning ghost straight into T2 at the insert,
        which is where vLLM's ARC would use on_store_miss."""
        chunks = self._chunks
        for req_id in req_ids:
            pending = self._requests.pop(req_id, None)
            if pending is None:
                continue
            for key in reversed(pending.inserts):
                chunk = chunks.get(key)
                if chunk is not None:
                    self._policy.insert(key, chunk)
            used = [k for k in reversed(pending.uses) if k in chunks]
            if used:
                self._policy.touch(used)


class TierkvLRU(TierkvPolicy):
    """tierkv's LRU (`tierkv.core.policies.lru`)."""

    policy_name = "lru"


class TierkvARC(TierkvPolicy):
    """tierkv's ARC (`tierkv.core.policies.arc`)."""

    policy_name = "arc"


class TierkvHistARC(TierkvPolicy):
    """tierkv's histarc (`tierkv.core.policies.histarc`): ARC with a long ghost
    history; the best of tierkv's policies on multi-turn conversation traces."""

    policy_name = "histarc"


class TierkvHitDensity(TierkvPolicy):
    """tierkv's hitdensity (`tierkv.core.policies.density`, tierkv's default): hit
    density per class of block, and the request's hints (vLLM's `kv_hints`)."""

    policy_name = "hitdensity"


_CLASSES: dict[str, type[TierkvPolicy]] = {
    cls.policy_name: cls for cls in (TierkvLRU, TierkvARC, TierkvHistARC, TierkvHitDensity)
}


def _known_keys(req_context: ReqContext) -> list[OffloadKey]:
    """Every key vLLM has made for the request so far (checked at start)."""
    return [OffloadKey(k) for k in request_keys(req_context)]


def _normal(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def class_name(policy: str) -> str:
    """The class name of a registered tierkv policy: `histarc` -> `TierkvHistARC`."""
    cls = _CLASSES.get(policy)
    if cls is not None:
        return cls.__name__
    return CLASS_PREFIX + "".join(part.capitalize() for part in re.split(r"[^0-9A-Za-z]+", policy))


def policy_class_names() -> list[str]:
    """The class names of every policy in tierkv's registry, for `eviction_policy`."""
    return sorted(class_name(name) for name in known_policies())


def policy_class(policy: str) -> type[TierkvPolicy]:
    """The vLLM policy class of a tierkv registry name (`"histarc"`), made once.

    Raises ValueError naming the known policies for a name not in the registry."""
    if policy not in known_policies():
        raise ValueError(
            f"unknown tierkv cache policy {policy!r}; known policies: "
            f"{', '.join(known_policies())}"
        )
    cls = _CLASSES.get(policy)
    if cls is None:
        cls = _CLASSES[policy] = type(class_name(policy), (TierkvPolicy,), {
            "policy_name": policy,
            "__doc__": f"tierkv's {policy!r} policy, from tierkv's policy registry.",
            "__module__": __name__,
        })
    return cls


def __getattr__(attr: str) -> type[TierkvPolicy]:
    """`Tierkv<Name>` for any policy in tierkv's registry: vLLM's factory looks the
    class up with getattr, so a policy registered after this module was written
    needs no class here."""
    if attr.startswith("__"):  # import machinery and introspection probe dunders
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    if attr.startswith(CLASS_PREFIX):
        wanted = _normal(attr[len(CLASS_PREFIX):])
        for policy in known_policies():
            if _normal(policy) == wanted:
                return policy_class(policy)
    # vLLM passes this error on as it is, so it says what eviction_policy may be.
    raise AttributeError(
        f"module {__name__!r} has no cache policy {attr!r}; with "
        f"cache_policy_module_path={__name__!r}, eviction_policy is one of "
        f"{', '.join(policy_class_names())}"
    )
