"""Off the scheduler's critical path: a store takes rows reserved ahead
(no round trip in the step), a new request is looked up when vLLM adds it (answered
in the step that first asks), and lookups queued together share a round trip. Each
with the node's own account of what it holds: a real node (broker and disk tier
processes), vLLM's real scheduler and connector."""

from __future__ import annotations

import signal
import time

import pytest

from tests.vllm.conftest import (
    SHAPE,
    chunk_keys,
    end_step,
    extra_config,
    manager_of,
    request,
    settle,
)
from tests.vllm.test_connector import DOC_BLOCKS, documents, run_round
from tests.vllm.test_manager import stored
from tierkv.bench.vllm_engine import Engine
from tierkv.client import Client
from tierkv.vllm.link import BrokerLink
from tierkv.vllm.lookups import HIT_STEPS


def test_a_store_takes_rows_reserved_ahead_and_needs_no_round_trip(start_node, engine_on):
    node = start_node(cpu_blocks=256)
    m = manager_of(engine_on(node))
    stored(m, chunk_keys(4, seed=1))  # a demand for rows: the step's end reserves spares
    end_step(m)
    settle(m)
    assert len(m.spares) >= 4
    keys = chunk_keys(3, seed=2)
    ctx = request("w", keys)
    node.kill("broker", signal.SIGSTOP)  # a round trip now would not come back
    try:
        with m.lock:
            out = m.prepare_store(keys, ctx)
    finally:
        node.kill("broker", signal.SIGCONT)
    assert out is not None and out.keys_to_store == keys
    with Client.from_config(node.config) as other:
        blocks = m.keymap.keys(keys)
        assert other.lookup(blocks).hits == 0  # not a hit before it is written
        with m.lock:
            m.complete_store(set(keys), ctx)
        settle(m)
        found = other.lookup(blocks, "reader", pin=True)
        assert found.hits == 3 and found.rows == out.store_spec.rows.tolist()
        other.release(blocks)
        assert other.stats(verify=True)["invariants"] == "ok"


def test_a_block_another_engine_stored_meanwhile_is_not_stored_twice(start_node, engine_on):
    node = start_node(cpu_blocks=256)
    first, second = (manager_of(engine_on(node)) for _ in range(2))
    for m, seed in ((first, 1), (second, 2)):
        stored(m, chunk_keys(4, seed=seed))
        end_step(m)
        settle(m)
    keys = chunk_keys(2, seed=3)
    a, b = request("a", keys), request("b", keys)
    with first.lock:
        mine = first.prepare_store(keys, a)
    with second.lock:
        theirs = second.prepare_store(keys, b)
    assert mine.keys_to_store == keys and theirs.keys_to_store == keys  # both guessed
    with second.lock:
        second.complete_store(set(keys), b)
    settle(second)
    with first.lock:
        first.complete_store(set(keys), a)
    settle(first)
    with Client.from_config(node.config) as other:
        found = other.lookup(first.keymap.keys(keys), "reader", pin=True)
        assert found.hits == 2 and found.rows == theirs.store_spec.rows.tolist()
        other.release(first.keymap.keys(keys))
        stats = other.stats(verify=True)
    assert stats["invariants"] == "ok"
    assert stats["cpu"]["blocks_writing"] == len(first.spares) + len(second.spares)


def test_a_new_request_is_answered_in_the_step_that_first_asks_for_it(start_node):
    """With no lookup of its own in the step (`sync_lookups` 0), every request added
    between steps still has its answers when the step scans it: all of a round's
    cached prefixes are hits in its first step."""
    node = start_node(cpu_blocks=256)
    shape = SHAPE.__class__(**{**SHAPE.__dict__, "gpu_blocks": 128})
    writer = Engine(shape, extra_config(node), name="writer")
    reader = Engine(shape, extra_config(node, sync_lookups=0), name="reader")
    try:
        docs = documents(4)
        run_round(writer, docs, 0)
        settle(manager_of(writer))
        for doc in docs:
            reader.add(doc + [7, 8, 1], max_tokens=2)
        reader.step()
        assert reader.tokens["external_hits"] == len(docs) * DOC_BLOCKS * SHAPE.block_size
        reader.run()
    finally:
        writer.close()
        reader.close()
    assert reader.mismatches == []


def test_calls_are_answered_in_order_and_one_given_up_comes_back_late(start_node):
    """The link has no thread: replies wait in the socket until the scheduler looks.
    A call given up is handed back when its reply comes; a plain call made on the
    same client meanwhile gets its own reply, and the posted ones keep theirs."""
    node = start_node(cpu_blocks=64)
    with Client.from_config(node.config) as writer:
        keys = [bytes([i]) * 16 for i in range(6)]
        writer.reserve(keys, "w")
        writer.commit(keys)
    link = BrokerLink(Client.from_config(node.config))
    try:
        node.kill("broker", signal.SIGSTOP)
        try:
            calls = [link.send(link.batch().lookup(keys[:i + 1], f"r{i}", pin=True))
                     for i in range(5)]
            assert not calls[0].wait(0.05)
            assert calls[0].abandon()
        finally:
            node.kill("broker", signal.SIGCONT)
        assert link.client.lookup(keys, "plain").hits == 6  # replies of the others kept
        assert calls[-1].wait(10.0) and all(call.done for call in calls)
        assert [call.results[0].hits for call in calls] == [1, 2, 3, 4, 5]
        assert link.take_late() == [calls[0]] and link.take_late() == []
    finally:
        link.close()



def looked_up_ahead(m) -> None:
    """Wait (bounded) for the manager's look-ups sent ahead of vLLM's asks."""
    for call in list(m.rounds.prefetches):
        assert call.wait(10.0)


def four_requests_two_slots(node, max_tokens: tuple[int, ...], **options) -> dict[str, int]:
    """Four requests on an engine that runs two at most, the third's prefix stored
    by another engine first (a hit), the others new (misses): how many times vLLM
    asked tierkv about each."""
    shape = SHAPE.__class__(**{**SHAPE.__dict__, "gpu_blocks": 128, "max_num_seqs": 2})
    writer = Engine(shape, extra_config(node), name="writer")
    reader = Engine(shape, extra_config(node, sync_lookups=0, **options), name="reader")
    asks: dict[str, int] = {}
    ask = reader.scheduler.connector.get_num_new_matched_tokens

    def counted(request, *args, **kwargs):
        asks[request.request_id] = asks.get(request.request_id, 0) + 1
        return ask(request, *args, **kwargs)

    reader.scheduler.connector.get_num_new_matched_tokens = counted
    try:
        docs = documents(4)
        run_round(writer, docs[2:3], 0)
        settle(manager_of(writer))
        for i, doc in enumerate(docs):
            reader.add(doc + [7, 8, 1], max_tokens=max_tokens[i], req_id=f"r{i}")
        reader.run()
    finally:
        writer.close()
        reader.close()
    assert reader.tokens["external_hits"] == DOC_BLOCKS * SHAPE.block_size
    assert reader.mismatches == []
    return asks


def test_a_request_deferred_while_the_engine_is_full_is_answered_when_it_has_room(start_node):
    """vLLM asks about a request it deferred (RETRY) again only once it has room for
    it, often steps later: the answers must be there then, misses too (hits stay
    pinned for a few steps anyway), not gone with the step they were first meant
    for. Nothing looked up ahead: every request is deferred at its first ask; the
    first two take both slots in the step after, and the third and fourth wait for
    a slot. Each is admitted at its second ask."""
    node = start_node(cpu_blocks=256)
    asks = four_requests_two_slots(node, (2, 8, 2, 2), prefetch_requests=0)
    assert asks == {f"r{i}": 2 for i in range(4)}


def test_a_request_waiting_in_the_queue_is_answered_at_its_first_ask(start_node):
    """A request waits in vLLM's queue until a running one makes room, here for
    longer than a hit stays pinned for it: the answers looked up when vLLM added it
    are kept fresh until vLLM asks, so it is admitted at its first ask, as with
    vLLM's own manager (none is answered by a round trip of its own in the step)."""
    node = start_node(cpu_blocks=256)
    asks = four_requests_two_slots(node, (12, 12, 2, 2))
    assert asks == {f"r{i}": 1 for i in range(4)}


def test_a_preempted_request_is_answered_when_vllm_scans_it_again(start_node, engine_on):
    """vLLM puts a request it preempts back at the head of its queue and scans it
    again once it has room, here after longer than any answer serves: its answers
    are kept fresh meanwhile, as a queued request's, so it is not told RETRY."""
    from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext

    node = start_node(cpu_blocks=256)
    m = manager_of(engine_on(node, sync_lookups=0))
    keys = chunk_keys(4, seed=6)
    stored(m, keys[:2])
    ctx = request("p", keys)
    expected = [LookupResult.HIT] * 2 + [LookupResult.MISS]
    with m.lock:
        m.prefetch(ctx)
        assert [m.lookup(k, ctx) for k in keys[:3]] == expected  # vLLM's scan stops
        m.on_schedule_end(ScheduleEndContext((), ("p",)))
    for _ in range(2 * HIT_STEPS):  # steps in which vLLM has no room for it
        looked_up_ahead(m)
        end_step(m)
    with m.lock:
        assert [m.lookup(k, ctx) for k in keys[:3]] == expected
        m.on_request_finished(ctx)
    settle(m)
    assert not m.holdings.pins


def queued_lookups(m, steps: int, other: Client) -> int:
    """The broker's lookups while `ctx` waits in vLLM's queue for `steps` steps."""
    before = other.stats()["cpu"]["lookups"]
    for _ in range(steps):
        looked_up_ahead(m)
        end_step(m)
    return other.stats()["cpu"]["lookups"] - before


def test_a_queued_request_is_looked_up_again_only_as_its_answers_expire(start_node,
                                                                       engine_on):
    """Kept answered while it waits, a queued request of an engine that hears nothing
    else from the broker (it stores nothing) costs a lookup each time its answers
    expire, and its misses serve as long as its hits (`QUEUED_STEPS`): a lookup every
    few steps, not one a step. A hit among them is still a hit when vLLM asks."""
    from vllm.v1.kv_offload.base import LookupResult

    node = start_node(cpu_blocks=256)
    m = manager_of(engine_on(node, sync_lookups=0))
    keys = chunk_keys(4, seed=8)
    stored(m, keys[:2])
    ctx = request("q", keys)
    steps = 4 * HIT_STEPS
    with m.lock:
        m.prefetch(ctx)
    with Client.from_config(node.config) as other:
        looked_up = queued_lookups(m, steps, other)
    # Its misses served one step before: a lookup each step. (+2: the look-up when
    # vLLM added it may reach the broker after the count began.)
    assert 1 <= looked_up <= steps // 4 + 2, looked_up
    with m.lock:
        assert [m.lookup(k, ctx) for k in keys[:3]] == [LookupResult.HIT] * 2 + [
            LookupResult.MISS]
        m.on_request_finished(ctx)
    settle(m)
    assert not m.holdings.pins


def busy_queued_lookups(m, steps: int, other: Client, seed: int) -> int:
    """`queued_lookups` of an engine that stores a block of another request at each
    step (a busy engine's: it hears from the broker every step)."""
    before = other.stats()["cpu"]["lookups"]
    for step, key in enumerate(chunk_keys(steps, seed=seed)):
        stored(m, [key], req_id=f"busy{step}")  # its steps' ends count too
        looked_up_ahead(m)
        end_step(m)
    looked_up_ahead(m)  # what the last step's end sent has reached the broker
    return other.stats()["cpu"]["lookups"] - before


def queued_half_stored(m, req_id: str, seed: int):
    """A request of four chunks, the first two of which `m` stored, added (looked up
    ahead) and waiting in vLLM's queue, its answers taken: two hits, then misses."""
    keys = chunk_keys(4, seed=seed)
    stored(m, keys[:2])
    ctx = request(req_id, keys)
    with m.lock:
        m.prefetch(ctx)
    looked_up_ahead(m)
    end_step(m)
    return keys, ctx


def scanned_as(m, keys, ctx, expected) -> None:
    """vLLM scans the request at last, its answers `expected`; it finishes, and the
    engine lets go of every pin."""
    with m.lock:
        assert [m.lookup(k, ctx) for k in keys] == expected
        m.on_request_finished(ctx)
    settle(m)
    assert not m.holdings.pins


def test_a_queued_request_s_misses_are_kept_while_nothing_arrives_at_the_node(
        start_node, engine_on):
    """A miss turns into a hit only when a block arrives at the node, and every reply
    says how many arrived other than by this engine's own stores: while that count
    does not move, a busy engine keeps a waiting request's misses (and its hits while
    their pins hold) without asking again, however many steps it waits."""
    from vllm.v1.kv_offload.base import LookupResult

    node = start_node(cpu_blocks=256)
    m = manager_of(engine_on(node, sync_lookups=0))
    keys, ctx = queued_half_stored(m, "kept", seed=12)
    with Client.from_config(node.config) as other:
        assert busy_queued_lookups(m, 4 * HIT_STEPS, other, seed=112) == 0
    scanned_as(m, keys[:3], ctx, [LookupResult.HIT] * 2 + [LookupResult.MISS])


def test_a_queued_request_finds_what_another_engine_stored_while_it_waited(start_node,
                                                                            engine_on):
    """Another engine of the same model stores the blocks a waiting request missed:
    the count of arrivals moves, the waiting request's misses are looked up again
    within a few steps, and vLLM's ask finds them hits (loaded, not computed)."""
    from vllm.v1.kv_offload.base import LookupResult

    node = start_node(cpu_blocks=256)
    m, writer = (manager_of(engine_on(node, sync_lookups=0)) for _ in range(2))
    keys, ctx = queued_half_stored(m, "finds", seed=13)
    with Client.from_config(node.config) as other:
        assert busy_queued_lookups(m, HIT_STEPS, other, seed=113) == 0
        stored(writer, keys[2:], req_id="elsewhere")
        assert busy_queued_lookups(m, 2 * HIT_STEPS, other, seed=114) >= 1
    scanned_as(m, keys, ctx, [LookupResult.HIT] * 4)


def queued_with_hits(node, engine_on, req_id: str, seed: int):
    """An engine on `node` and a request of four chunks it stored, added (looked up
    ahead) and waiting in vLLM's queue."""
    m = manager_of(engine_on(node, sync_lookups=0))
    keys = chunk_keys(4, seed=seed)
    stored(m, keys)
    ctx = request(req_id, keys)
    with m.lock:
        m.prefetch(ctx)
    return m, keys, ctx


def scanned_as_hits(m, keys, ctx, other: Client) -> None:
    """vLLM scans the request at last: every chunk a hit. It finishes; the engine
    let go of its pins, none of which the broker had to expire."""
    from vllm.v1.kv_offload.base import LookupResult

    with m.lock:
        assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * len(keys)
        m.on_request_finished(ctx)
    settle(m)
    assert other.stats()["owners"]["pins_expired"] == 0
    assert not m.holdings.pins


def test_a_queued_request_s_hits_are_held_while_it_waits_not_looked_up_again(start_node,
                                                                            engine_on):
    """At the head of vLLM's queue, a request's hits stay pinned for it: the broker
    holds a pin for `broker.pin_s`, which its reply says, so they are kept without a
    lookup for a share of that however many steps the request waits, and they are
    still hits when vLLM asks."""
    node = start_node(cpu_blocks=256)
    m, keys, ctx = queued_with_hits(node, engine_on, "held", seed=10)
    looked_up_ahead(m)
    end_step(m)  # its answers taken: every key a hit
    with Client.from_config(node.config) as other:
        # Renewed by lookups, it was looked up once every `HIT_STEPS`.
        assert queued_lookups(m, 4 * HIT_STEPS, other) == 0
        scanned_as_hits(m, keys, ctx, other)


def test_a_queued_request_s_hits_are_looked_up_again_before_their_pins_end(start_node,
                                                                          engine_on):
    """A hit held for a waiting request is asked about again before the broker's pin
    on it could end (`broker.pin_s`, short here), so no pin it loads through has
    lapsed: the broker never had to release one."""
    pin_s = 0.6
    node = start_node(cpu_blocks=256, broker={"pin_s": pin_s})
    m, keys, ctx = queued_with_hits(node, engine_on, "renewed", seed=11)
    with Client.from_config(node.config) as other:
        looked_up, until = 0, time.monotonic() + 3 * pin_s
        while time.monotonic() < until:  # steps of an engine whose queue does not move
            looked_up += queued_lookups(m, 1, other)
            time.sleep(0.01)
        assert looked_up >= 4, looked_up  # once per half a pin_s, at least
        scanned_as_hits(m, keys, ctx, other)


@pytest.mark.parametrize("stored_when", ["before the step's end", "after it"])
def test_a_queued_request_finds_what_this_engine_stored_while_it_waited(
        start_node, engine_on, stored_when):
    """Many requests share a prefix: one computes and stores it while another waits
    in the queue with misses for it, answers that still serve. Those misses are
    looked up again, at the step's end that follows the store or, stored after it,
    when vLLM asks: the waiting request loads the prefix, as with vLLM's own
    manager, rather than computing it again."""
    from vllm.v1.kv_offload.base import LookupResult

    node = start_node(cpu_blocks=256)
    before = stored_when == "before the step's end"
    # Stored before: the step's end looks them up (no round trip of its own in the
    # step: `sync_lookups` 0). After: the step that asks, within its budget.
    m = manager_of(engine_on(node, sync_lookups=0 if before else 2))
    keys = chunk_keys(4, seed=9)
    waiting, writing = request("waiting", keys), request("writing", keys)
    with m.lock:
        m.prefetch(waiting)
    looked_up_ahead(m)

    def store() -> None:
        with m.lock:
            out = m.prepare_store(keys, writing)
            assert out is not None and out.keys_to_store == keys
            m.complete_store(set(keys), writing)
        time.sleep(m.options.flush_s * 2)  # the commit is due: the step's end sends it

    if before:
        store()
    end_step(m)  # takes the waiting request's misses, which serve steps yet
    if not before:
        store()
    with m.lock:
        assert [m.lookup(k, waiting) for k in keys] == [LookupResult.HIT] * len(keys)
        m.on_request_finished(waiting)
    settle(m)
    assert not m.holdings.pins


def test_a_block_this_engine_stored_and_the_node_evicted_is_stored_again(start_node,
                                                                         engine_on):
    """The engine remembers what it stored (stores of it are skipped). Evicted since,
    a waiting request's miss for it is looked up again once, and the miss it finds
    again makes the engine forget it: the next store of it writes it."""
    from vllm.v1.kv_offload.base import LookupResult

    node = start_node(cpu_blocks=16, disk_blocks=0)  # evicted is gone: no disk tier
    m = manager_of(engine_on(node, spare_rows=0))
    keys = chunk_keys(1, seed=10)  # a leading run's first miss: known absent
    stored(m, keys)
    with Client.from_config(node.config) as other:
        others = [bytes([40, i]) * 16 for i in range(16)]
        other.reserve(others, "filler")
        other.commit(others)
        assert other.lookup(m.keymap.keys(keys)).hits == 0  # evicted
    waiting = request("waiting", keys)
    with m.lock:
        m.prefetch(waiting)
    looked_up_ahead(m)
    end_step(m)
    with m.lock:
        assert m.lookup(keys[0], waiting) is LookupResult.MISS
        out = m.prepare_store(keys, request("again", keys))
    assert out is not None and out.keys_to_store == keys


def test_a_stale_miss_with_no_budget_left_leaves_the_request_s_answers_standing(
        start_node, engine_on):
    """A miss of a block this engine stored since is looked up again only within
    the step's budget; with none left, the request's misses stand (computed), none
    turns into a RETRY (a step of waiting) for a scan that goes on past a miss."""
    from vllm.v1.kv_offload.base import LookupResult

    node = start_node(cpu_blocks=256)
    m = manager_of(engine_on(node, sync_lookups=0))
    keys = chunk_keys(2, seed=11)
    waiting, writing = request("waiting", keys), request("writing", keys[:1])
    with m.lock:
        m.prefetch(waiting)
    looked_up_ahead(m)
    end_step(m)  # takes its misses, which serve steps yet
    with m.lock:
        out = m.prepare_store(keys[:1], writing)
        assert out is not None and out.keys_to_store == keys[:1]
        m.complete_store(set(keys[:1]), writing)
        assert [m.lookup(k, waiting) for k in keys] == [LookupResult.MISS] * 2
        m.on_request_finished(waiting)
    settle(m)
