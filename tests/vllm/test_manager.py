"""tierkv's `TierkvOffloadingManager` called the way vLLM 0.33's scheduler calls it
when its real call patterns get in the way of each other: many requests offering the
same chunk in one step, an engine that stops or resets with copies in flight, a
broker that stops answering for a while, keys asked in any order.

The manager is the one vLLM's real connector builds (an `Engine` with its scheduler
side only), and it talks to a real node (broker and disk tier processes); what the
node holds is read back by a client of its own.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
from vllm.v1.kv_offload.base import LookupResult

from tests.vllm.conftest import (
    SHAPE,
    chunk_keys,
    end_step,
    extra_config,
    manager_of,
    node_statuses,
    request,
    settle,
)
from tierkv.bench.vllm_engine import Engine
from tierkv.client import Client, Lookup


def stored(manager, keys: list[bytes], req_id: str = "writer") -> None:
    """`keys` stored through the manager, committed and settled."""
    ctx = request(req_id, keys)
    with manager.lock:
        out = manager.prepare_store(keys, ctx)
        assert out is not None and out.keys_to_store == keys
        manager.complete_store(set(keys), ctx)
    settle(manager)


# -- item 1: a chunk is a hit only once the job that writes it is done ----------------------


def test_a_chunk_two_requests_offer_is_written_and_committed_by_one_job(start_node, engine_on):
    node = start_node(cpu_blocks=32)
    m = manager_of(engine_on(node))
    keys = chunk_keys(3)
    first, second, reader = (request(n, keys) for n in ("first", "second", "reader"))
    with m.lock:
        out_first = m.prepare_store(keys, first)
        out_second = m.prepare_store(keys, second)  # the same chunks, the same step
    assert out_first is not None and out_first.keys_to_store == keys
    # In flight already: vLLM's own manager leaves them out too, so the second job
    # writes nothing, and its end commits nothing.
    assert out_second is not None and out_second.keys_to_store == []
    with m.lock:
        m.complete_store(set(keys), second)
    settle(m)
    blocks = m.keymap.keys(keys)
    assert node_statuses(node, blocks) == ["pending"] * 3
    with m.lock:
        assert m.lookup(keys[0], reader) is not LookupResult.HIT
        m.complete_store(set(keys), first)
    settle(m)
    assert node_statuses(node, blocks) == ["hit"] * 3


def test_a_store_with_no_room_now_is_offered_again_and_then_stored(start_node, engine_on):
    node = start_node(cpu_blocks=4, disk_blocks=0)
    m = manager_of(engine_on(node))
    with Client.from_config(node.config) as other:
        theirs = [b"other-%d" % i for i in range(4)]
        other.reserve(theirs)
        other.commit(theirs)
        other.pin(theirs)  # every CPU row in use by another engine's reads
        keys = chunk_keys(2)
        ctx = request("r", keys)
        with m.lock:
            assert m.prepare_store(keys, ctx) is None  # vLLM offers them again next step
        other.release(theirs)
        end_step(m)
        with m.lock:
            out = m.prepare_store(keys, ctx)
            assert out is not None and out.keys_to_store == keys
            m.complete_store(set(keys), ctx)
    settle(m)
    assert node_statuses(node, m.keymap.keys(keys)) == ["hit", "hit"]


# -- item 2: nothing this engine started stays pending ---------------------------------------


def test_an_engine_that_shuts_down_with_a_store_in_flight_leaves_nothing_pending(
        start_node, engine_on):
    node = start_node(cpu_blocks=32)
    engine = engine_on(node)
    m = manager_of(engine)
    keys = chunk_keys(3)
    with m.lock:
        assert m.prepare_store(keys, request("r", keys)).keys_to_store == keys
    blocks = m.keymap.keys(keys)
    assert node_statuses(node, blocks) == ["pending"] * 3
    engine.close()  # vLLM: the workers stopped, then the scheduler's connector
    assert node_statuses(node, blocks) == ["miss"] * 3


def test_a_reset_with_copies_in_flight_lets_go_once_the_workers_are_done(
        start_node, engine_on):
    node = start_node(cpu_blocks=4, disk_blocks=0)
    m = manager_of(engine_on(node))
    old, new = chunk_keys(2, seed=1), chunk_keys(2, seed=2)
    stored(m, old)
    ctx = request("r", old + new)
    with m.lock:
        assert [m.lookup(k, ctx) for k in old] == [LookupResult.HIT] * 2
        m.prepare_load(old, ctx)  # a load in flight: its rows pinned
        assert m.prepare_store(new, ctx).keys_to_store == new  # a store in flight
        m.reset_cache()
    settle(m)
    rows_for = [b"another-%d" % i for i in range(4)]  # every row of the CPU tier
    with Client.from_config(node.config) as other:
        # The workers may still copy those rows: they stay held...
        assert not other.reserve(rows_for).ok
        with m.lock:
            m.on_reset_flushed()  # ...until vLLM says every job of before the reset ended
        settle(m)
        assert other.reserve(rows_for).ok


def test_a_commit_owed_while_the_broker_was_stopped_is_not_dropped(start_node, engine_on):
    node = start_node(cpu_blocks=32)
    m = manager_of(engine_on(node, timeout_s=0.5, retry_s=0.2))
    keys = chunk_keys(2)
    ctx = request("r", keys)
    with m.lock:
        assert m.prepare_store(keys, ctx).keys_to_store == keys
        m.complete_store(set(keys), ctx)  # owed: rides the step's round trip
    node.kill("broker", signal.SIGSTOP)
    try:
        end_step(m)  # the round trip gets no reply: the broker counts as down
        m.link.send(m.link.batch()).wait(5.0)  # the lost call has ended after this one
        with m.lock:
            m.has_pending_work()  # takes the lost call's end
    finally:
        node.kill("broker", signal.SIGCONT)
    settle(m)
    assert node_statuses(node, m.keymap.keys(keys)) == ["hit", "hit"]


def idle(manager, timeout_s: float = 10.0) -> None:
    """vLLM's engine loop once it has no request left: one more step for each True of
    `has_pending_work`, then nothing until a request comes (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with manager.lock:
            if not manager.has_pending_work():
                return
        end_step(manager)
        assert time.monotonic() < deadline, "the engine never went idle"


def test_an_engine_going_idle_while_the_broker_is_slow_still_commits_its_stores(
        start_node, engine_on):
    """vLLM stops stepping an engine with no request left once `has_pending_work`
    says no. An engine whose broker was slow (a round trip out past
    `lookup_wait_ms`) said no while it owed
    its stores' commits: the blocks stayed reserved, being written, and another
    engine's requests for them were told RETRY, every step, until the broker
    withdrew the reservations (`broker.reservation_s`, 60 s)."""
    node = start_node(cpu_blocks=32)
    m = manager_of(engine_on(node, spare_rows=0, lookup_wait_ms=100.0))
    keys = chunk_keys(2, seed=13)
    ctx = request("w", keys)
    with m.lock:
        assert m.prepare_store(keys, ctx).keys_to_store == keys  # reserved: being written
        m.complete_store(set(keys), ctx)  # its commit is owed, sent at a step's end
    node.kill("broker", signal.SIGSTOP)  # slow: nothing answers for a while
    try:
        with m.lock:
            m.prefetch(request("new", chunk_keys(2, seed=14)))  # a round trip now out
        time.sleep(m.options.lookup_wait_ms / 1e3 + 0.05)
        engine = threading.Thread(target=idle, args=(m,))
        engine.start()
        time.sleep(0.2)
    finally:
        node.kill("broker", signal.SIGCONT)
    engine.join(15.0)
    assert not engine.is_alive()
    deadline = time.monotonic() + 10.0
    while node_statuses(node, m.keymap.keys(keys)) != ["hit", "hit"]:
        assert time.monotonic() < deadline, m.holdings.owed  # committed, not left owed
        time.sleep(0.05)


def test_a_store_offered_again_after_its_reserve_was_given_up_is_committed(
        start_node, engine_on):
    """`prepare_store` gives up waiting past the step's budget and vLLM offers the
    store again the next step. The broker answers the second reserve with the
    engine's own reservation of the first, renewed. The first's late reply must not
    abort it: the row would be freed under the copy writing it, and the commit naming
    it refused whole, leaving every other block of that commit reserved (pending for
    every engine) until `broker.reservation_s` withdrew it."""
    node = start_node(cpu_blocks=32)
    m = manager_of(engine_on(node, spare_rows=0, budget_ms=50.0))
    keys, others = chunk_keys(2, seed=21), chunk_keys(2, seed=22)
    ctx, other_ctx = request("r", keys), request("o", others)
    node.kill("broker", signal.SIGSTOP)
    try:
        with m.lock:
            assert m.prepare_store(keys, ctx) is None  # past the budget: given up
        m.rounds.budget_ms = 10_000.0  # the next step's reserve waits for its reply
        end_step(m)
        threading.Timer(0.2, node.kill, ("broker", signal.SIGCONT)).start()
        with m.lock:
            again = m.prepare_store(keys, ctx)  # sent before the first one's reply came
    finally:
        time.sleep(0.3)
        node.kill("broker", signal.SIGCONT)
    assert again is not None and again.keys_to_store == keys
    with m.lock:
        assert m.prepare_store(others, other_ctx).keys_to_store == others
        m.complete_store(set(keys), ctx)
        m.complete_store(set(others), other_ctx)  # one commit for the four
    settle(m)
    assert node_statuses(node, m.keymap.keys(keys + others)) == ["hit"] * 4


def test_a_block_another_engine_is_slow_to_write_is_computed_after_pending_wait_ms(
        start_node, engine_on):
    """A request waits for a block another engine is writing (vLLM is told RETRY),
    but only `pending_wait_ms`, counted from the first RETRY (vLLM's scan asks the
    hit before it again at every step): a writer that stopped is ended by the broker
    only after `broker.owner_timeout_s` (30 s), its reservation after
    `broker.reservation_s`, and computing is cheaper than waiting that long."""
    node = start_node(cpu_blocks=32)
    m = manager_of(engine_on(node, pending_wait_ms=300.0))
    keys = chunk_keys(3, seed=25)
    stored(m, keys[:1])
    ctx = request("r", keys)
    with Client.from_config(node.config) as writer:
        assert writer.reserve(m.keymap.keys(keys[1:])).ok  # being written, never committed
        told: list[LookupResult] = []
        start = time.monotonic()
        while not told or told[-1] is not LookupResult.MISS:
            assert time.monotonic() - start < 10.0, told[-5:]
            with m.lock:
                assert m.lookup(keys[0], ctx) is LookupResult.HIT
                told.append(m.lookup(keys[1], ctx))
            end_step(m)
            time.sleep(0.01)
        waited = time.monotonic() - start
        assert set(told[:-1]) == {LookupResult.RETRY} and len(told) > 2
        assert 0.3 <= waited < 5.0
        assert node_statuses(node, m.keymap.keys(keys[1:])) == ["pending"] * 2


def test_a_commit_naming_a_block_the_broker_let_go_commits_the_others(start_node, engine_on):
    """The broker refuses a commit group whole when one key is not the engine's (here
    its reservation was aborted behind the manager's back): the other blocks of the
    group are committed all the same, not left pending for every engine."""
    node = start_node(cpu_blocks=32)
    m = manager_of(engine_on(node, spare_rows=0))
    lost, kept = chunk_keys(1, seed=23), chunk_keys(3, seed=24)
    lost_ctx, kept_ctx = request("lost", lost), request("kept", kept)
    with m.lock:
        assert m.prepare_store(lost, lost_ctx).keys_to_store == lost
        assert m.prepare_store(kept, kept_ctx).keys_to_store == kept
    behind = m.link.batch()
    behind.commit(m.keymap.keys(lost), False)
    assert m.link.send(behind).wait(10.0)
    with m.lock:
        m.complete_store(set(lost), lost_ctx)
        m.complete_store(set(kept), kept_ctx)  # one commit group for the four
    settle(m)
    assert node_statuses(node, m.keymap.keys(lost + kept)) == ["miss"] + ["hit"] * 3


# -- item 6: any order converges ----------------------------------------------------------


@pytest.mark.parametrize("sync_lookups", [2, 0])
def test_keys_asked_last_to_first_are_answered_within_two_steps(
        start_node, engine_on, sync_lookups):
    """vLLM's sliding-window scan asks a request's keys from the end."""
    from dataclasses import replace

    shape = replace(SHAPE, sliding_window=4 * SHAPE.block_size)
    node = start_node(cpu_blocks=64)
    m = manager_of(engine_on(node, shape=shape, sync_lookups=sync_lookups))
    full, window = chunk_keys(6, group=0), chunk_keys(6, group=1)
    stored(m, full + window)
    ctx = request("asker", full, window)
    answers: list[list[LookupResult]] = []
    for _ in range(2):
        with m.lock:
            answers.append([m.lookup(k, ctx) for k in reversed(window)])
        end_step(m)
        m.link.send(m.link.batch()).wait(10.0)  # the step's round trip is back
    assert answers[-1] == [LookupResult.HIT] * 6, answers


def test_keys_are_split_by_group_as_vllm_reads_a_key_s_group():
    """A request's keys go to their KV-cache group by their last 4 bytes, read once per
    group: the same split as vLLM's `get_offload_group_idx` key by key, in order."""
    from vllm.v1.kv_offload.base import OffloadKey, get_offload_group_idx

    from tierkv.vllm.lookups import by_group

    chains = [chunk_keys(5, group=g, seed=g % 256) for g in (0, 1, 7, 256)]
    mixed = [key for four in zip(*chains, strict=True) for key in four][::-1]
    expected: dict[int, list[bytes]] = {}
    for key in mixed:
        expected.setdefault(get_offload_group_idx(OffloadKey(key)), []).append(key)
    assert by_group(mixed) == expected
    assert list(expected) == [256, 7, 1, 0]
    assert by_group([]) == {}
    one = chains[1]
    split = by_group(one)  # one group: the keys as given, in a list of its own
    assert split == {1: one}
    split[1].sort()
    assert one == chains[1] and one is not split[1]


def test_keys_without_a_position_sort_before_those_vllm_placed():
    from tierkv.vllm.lookups import head_first

    keys = chunk_keys(4)
    ctx = request("r", keys)
    assert head_first(keys[::-1], ctx) == keys
    stray = chunk_keys(1, seed=9)[0]  # vLLM gave it no position
    assert head_first([keys[2], stray, keys[0]], ctx) == [stray, keys[0], keys[2]]


def test_a_load_naming_a_chunk_that_was_not_a_hit_reads_only_the_hits(start_node, engine_on):
    """vLLM loads only what lookup called a hit. Should a load name another chunk, it
    gets no row (the worker fails that block, recomputed) rather than another key's;
    the hits get the rows their lookup pinned, their pins pass to the load, and go
    when it completes."""
    node = start_node(cpu_blocks=8, disk_blocks=0)
    m = manager_of(engine_on(node))
    hits, stray = chunk_keys(3, seed=1), chunk_keys(1, seed=2)
    stored(m, hits)
    for chunks in (hits, [*hits[:2], *stray, hits[2]]):  # all hits; one that is not
        ctx = request("r", hits + stray)
        with m.lock:
            assert [m.lookup(k, ctx) for k in hits] == [LookupResult.HIT] * 3
            pinned = dict(m._requests["r"].rows)
            spec = m.prepare_load(chunks, ctx)
            assert list(spec.rows) == [pinned.get(c, -1) for c in chunks]
            assert sorted(pinned.values()) == sorted(r for r in spec.rows if r >= 0)
            m.complete_load(set(chunks), ctx)
            m.on_request_finished(ctx)
        settle(m)
        assert not m.holdings.pins


def test_a_leading_run_s_answers_pin_its_hits_and_share_one_answer_for_the_rest():
    """A lookup's reply read into per-chunk answers: each hit with its row (its key
    pinned for the request), a hit whose pin was refused a miss, and every chunk after
    the run one shared answer (retry when the broker said to ask again)."""
    from tierkv.vllm.lookups import read_answers

    chain = chunk_keys(6)
    found = Lookup(3, True, False, rows=[5, -1, 7, -1, -1, -1], region="r1", pin_s=10.0)
    answers, rows = read_answers(chain, found, until=4, asked_at=100.0, hits_until=6)
    assert list(answers) == chain
    assert rows == {chain[0]: 5, chain[2]: 7}  # the refused pin holds no row
    first, refused, third, *rest = (answers[c] for c in chain)
    assert (first.status, first.region, first.until) == (LookupResult.HIT, "r1", 6)
    assert first.held_until == 105.0  # half the broker's pin time, from the ask
    assert third.status is LookupResult.HIT
    assert refused.status is LookupResult.MISS and refused.until == 4
    assert {a.status for a in rest} == {LookupResult.RETRY} and len({id(a) for a in rest}) == 1
    all_pinned = Lookup(3, False, False, rows=[1, 2, 3, -1, -1, -1], region="r1")
    answers, rows = read_answers(chain, all_pinned, until=4, asked_at=100.0)
    assert rows == {chain[0]: 1, chain[1]: 2, chain[2]: 3}
    assert [answers[c].status for c in chain] == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 3
    lost, no_rows = read_answers(chain, None, until=4, asked_at=100.0)
    assert {a.status for a in lost.values()} == {LookupResult.MISS} and not no_rows


@pytest.mark.parametrize("found", [
    Lookup(3, True, False, rows=[5, 6, 7, -1, -1, -1]),  # a run, then ask again
    Lookup(3, True, True),  # a run, then nothing could start
    Lookup(3, False, False),  # a run, then misses
    Lookup(6, False, False),  # all hits
    Lookup(0, False, False, statuses=["hit", "miss", "pending", "miss", "hit", "miss"],
           rows=[1, -1, -1, -1, 2, -1]),  # key by key, one being written
    Lookup(0, False, False, statuses=["hit", "miss", "retry", "miss", "miss", "miss"]),
    Lookup(0, False, False, statuses=["hit", "miss", "miss", "miss", "hit", "miss"]),
    None,  # the lookup failed
], ids=["run-pending", "run-retry", "run-miss", "all-hits", "keys-pending", "keys-retry",
        "keys-miss", "failed"])
def test_whether_a_reply_defers_its_request_is_what_its_answers_say(found):
    """`defers` reads off the reply what its answers say (a request told RETRY or
    HIT_PENDING for a key is asked about again), without walking them."""
    from tierkv.vllm.lookups import AGAIN, defers, read_answers

    chain = chunk_keys(6)
    answers, _ = read_answers(chain, found, until=4, asked_at=100.0)
    assert defers(found, len(chain)) == any(a.status in AGAIN for a in answers.values())


def test_a_vllm_without_the_request_key_record_is_stopped_at_start(
        start_node, monkeypatch):
    """`sync_lookups` and tierkv's policies read vLLM's private record of a request's
    keys: a vLLM that does not keep it stops the engine at start, naming its
    version (and with `sync_lookups` 0 the connector needs none)."""
    import vllm
    from vllm.v1.kv_offload.base import ReqContext

    import tierkv.vllm.request_keys as request_keys
    from tierkv.vllm.policies import TierkvLRU

    class Renamed(ReqContext):
        def __getattribute__(self, name: str):
            if name == request_keys.RECORD:
                raise AttributeError(name)
            return super().__getattribute__(name)

    monkeypatch.setattr(request_keys, "ReqContext", Renamed)
    node = start_node(cpu_blocks=8)
    with pytest.raises(RuntimeError, match=f"vLLM {vllm.__version__}.*sync_lookups to 0"):
        Engine(SHAPE, extra_config(node), copy=False)
    with pytest.raises(RuntimeError, match=f"TierkvLRU cannot run on vLLM {vllm.__version__}"):
        TierkvLRU(cache_capacity=4)
    Engine(SHAPE, extra_config(node, sync_lookups=0), copy=False).close()


# -- item 10: the rest of vLLM's contract --------------------------------------------------


def test_a_chunk_offered_again_is_used_again(start_node, engine_on):
    """vLLM offers a GPU-cached prefix again for every request that shares it (and
    0.33 never calls `touch`): that keeps it in the node, tail before head."""
    node = start_node(cpu_blocks=4, disk_blocks=0, cpu={"policy": "lru"})
    m = manager_of(engine_on(node))
    shared, once = chunk_keys(2, seed=1), chunk_keys(2, seed=2)
    stored(m, shared, "first")
    stored(m, once, "second")
    with m.lock:  # offered again: present, so not stored, but used
        assert m.prepare_store(shared, request("third", shared)).keys_to_store == []
    settle(m)
    with Client.from_config(node.config) as other:
        assert other.reserve([b"new-0", b"new-1"]).ok  # two rows: the least recent go
    assert node_statuses(node, m.keymap.keys(shared)) == ["hit", "hit"]
    assert node_statuses(node, m.keymap.keys(once)) == ["miss", "miss"]


def test_shutdown_after_a_step_that_raised_does_not_hang(start_node, engine_on):
    """A `schedule()` that raised leaves vLLM's step region, and so the manager's
    lock, held; vLLM then calls `shutdown` without it."""
    import threading

    node = start_node(cpu_blocks=8)
    engine = engine_on(node)
    m = manager_of(engine)
    keys = chunk_keys(2)
    with m.lock:
        m.prepare_store(keys, request("r", keys))
    assert m.lock.acquire(timeout=5)  # left held by the step that raised
    try:
        stopping = threading.Thread(target=engine.close, daemon=True)
        stopping.start()
        stopping.join(timeout=60)
        assert not stopping.is_alive()
    finally:
        m.lock.release()
    assert node_statuses(node, m.keymap.keys(keys)) == ["miss", "miss"]
