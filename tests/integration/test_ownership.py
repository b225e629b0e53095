"""Who owns what: every reservation, pin and KV registration belongs to the
client that made it, has a deadline, and is let go when that client ends; no client
can act on another's, and no request can crash or stall the broker. A real node,
real clients (one of them a process killed mid-store)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.integration.cluster import key_bytes, keys, step_until, wait_for
from tierkv.client import Client, RemoteError
from tierkv.core.shm import SharedRegion
from tierkv.wire.protocol import MAX_GROUPS, MAX_STEP_KEYS, RequestContext


def write_rows(instance: str, block_keys: list[bytes], rows: list[int]) -> None:
    region = SharedRegion.attach(instance)
    try:
        for key, row in zip(block_keys, rows, strict=True):
            region.page(row, 0)[:] = key_bytes(key, 0, region.layout.page_size)
    finally:
        region.close()


def read_rows(instance: str, rows: list[int]) -> list[bytes]:
    region = SharedRegion.attach(instance)
    try:
        return [bytes(np.asarray(region.page(row, 0))) for row in rows]
    finally:
        region.close()


def settled(client) -> bool:
    return client.stats()["tiering"]["cascades_in_flight"] == 0


def test_a_client_cannot_release_anothers_pin_and_the_broker_lives_on(make_cluster, instance):
    """F1: a release of a key another client pinned, or a commit of a key a worker
    store is writing, used to raise at the next tick and end the broker."""
    cluster = make_cluster(cpu={"num_blocks": 8})
    engine, stranger = cluster.client(), cluster.client()
    ks = keys(1, 2, 3)
    reserved = engine.reserve(ks, "w")
    write_rows(instance, ks, reserved.block_ids)
    engine.commit(ks)
    step_until(engine, lambda: settled(engine))
    rows = engine.pin(ks, "reader")
    with pytest.raises(RemoteError) as refused:
        stranger.release(ks)
    assert refused.value.code == "not_owner" and ks[0].hex()[:16] in refused.value.message
    cluster.fill(keys(7), [5])
    store = engine.store(keys(7), [5])
    with pytest.raises(RemoteError, match="not_owner"):
        stranger.commit(keys(7), ok=False)  # the worker's store, not a reservation of its
    for _ in range(5):
        stranger.step()  # ticks that used to raise
    wait_for(engine, {store.job_id})
    assert read_rows(instance, rows) == [key_bytes(k, 0, 1024) for k in ks]
    engine.release(ks)
    assert engine.stats(verify=True)["invariants"] == "ok"
    assert engine.lookup([*ks, *keys(7)], "again").hits == 4


def test_a_client_cannot_commit_anothers_reservation(make_cluster, instance):
    """F2: a commit before the owner wrote its row served the row's old bytes."""
    cluster = make_cluster(cpu={"num_blocks": 8})
    engine, stranger = cluster.client(), cluster.client()
    ks = keys(1, 2)
    reserved = engine.reserve(ks, "w")
    with pytest.raises(RemoteError, match="not_owner"):
        stranger.commit(ks)
    assert stranger.lookup(ks, "r").pending  # still being written, not a hit
    write_rows(instance, ks, reserved.block_ids)
    engine.commit(ks)
    found = stranger.lookup(ks, "r2", pin=True)
    assert found.hits == 2
    assert read_rows(instance, found.rows) == [key_bytes(k, 0, 1024) for k in ks]
    stranger.release(ks)


def test_a_client_without_the_registrations_token_cannot_use_anothers_kv_cache(make_cluster):
    """F4: stores and loads name the engine's KV cache; only its registrant, or a
    client it gave the token to, may."""
    cluster = make_cluster(cpu={"num_blocks": 8})
    stranger = cluster.client()
    stranger.registration_tokens.clear()  # as a client that was never given them
    cluster.fill(keys(1), [0])
    with pytest.raises(RemoteError, match="not_owner"):
        stranger.store(keys(1), [0])
    friend = cluster.client()  # has the tokens (Cluster.client: Client.use_kv)
    wait_for(friend, {friend.store(keys(1), [0]).job_id})
    assert friend.lookup(keys(1), "r").hits == 1
    with pytest.raises(RemoteError, match="not_owner"):
        stranger.load(keys(1), [3], "r")
    stranger.use_kv({0: "0" * 32})
    with pytest.raises(RemoteError, match="not_owner"):
        stranger.load(keys(1), [3], "r")  # a made-up token is no token


ENGINE_THAT_DIES = """
import sys, time
from tierkv.client import Client
c = Client(sys.argv[1], timeout=10.0, ping_s=0.2)
keys = [b"dead" + i.to_bytes(4, "big") for i in range(int(sys.argv[2]))]
r = c.reserve(keys, "mid-store")
print("reserved", sum(b >= 0 for b in r.block_ids), flush=True)
time.sleep(600)
"""


def test_an_engine_killed_mid_store_frees_its_rows_within_the_owner_timeout(make_cluster):
    """F5: a client that reserved every CPU block and died left them `writing` for ever;
    every other client's store was refused and the prefix was pending for ever."""
    owner_timeout_s = 1.0
    cluster = make_cluster(cpu={"num_blocks": 8}, broker={"owner_timeout_s": owner_timeout_s})
    other = cluster.client()
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_THAT_DIES,
                             cluster.config.connect_address("client"), "8"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().split() == ["reserved", "8"]
        dead = [b"dead" + i.to_bytes(4, "big") for i in range(8)]
        assert other.lookup(dead, "r").pending
        assert not other.reserve(keys(1), "w").ok  # no room: all 8 are being written
        time.sleep(2 * owner_timeout_s)  # pings keep a live engine's rows its own
        assert other.stats()["cpu"]["blocks_writing"] == 8
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        killed_at = time.monotonic()
        step_until(other, lambda: other.stats()["cpu"]["blocks_writing"] == 0, timeout=10)
        freed_after = time.monotonic() - killed_at
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    found = other.lookup(dead, "r2")
    assert found.hits == 0 and not found.pending  # a miss, not pending for ever
    assert other.reserve(keys(1), "w").ok
    print(f"rows freed {freed_after:.2f}s after the kill (owner_timeout_s={owner_timeout_s})")


def test_a_client_given_only_the_address_is_not_ended_while_it_computes(make_cluster, instance):
    """A client made with the broker's address alone (vLLM's connector given
    `tierkv_address`, not the node's config) pinged every 5 s, so under an
    `owner_timeout_s` of 1 s the broker ended it while it was alive and computing:
    its reservations were aborted under the copies writing them and its commit was
    refused `not_owner`. The broker's replies say its owner timeout, and the client
    pings inside it."""
    owner_timeout_s = 1.0
    cluster = make_cluster(cpu={"num_blocks": 8}, broker={"owner_timeout_s": owner_timeout_s})
    engine = Client(cluster.config.connect_address("client"), timeout=10.0)
    try:
        reserved = engine.reserve(keys(1), "w")
        write_rows(instance, keys(1), reserved.block_ids)
        time.sleep(3 * owner_timeout_s)  # a long step: nothing to say to the broker
        engine.commit(keys(1))
        assert engine.lookup(keys(1), "r").hits == 1
    finally:
        engine.close()
    assert cluster.client().stats()["owners"]["owners_timed_out"] == 0


def test_a_closed_client_lets_go_of_what_it_held_at_once(make_cluster, instance):
    cluster = make_cluster(cpu={"num_blocks": 8}, broker={"owner_timeout_s": 60.0})
    engine, other = cluster.client(), cluster.client()
    reserved = engine.reserve(keys(1, 2), "w")
    write_rows(instance, keys(1), reserved.block_ids[:1])
    engine.commit(keys(1))
    engine.lookup(keys(1), "r", pin=True)
    engine.close()
    step_until(other, lambda: other.stats()["cpu"]["blocks_writing"] == 0)
    assert other.stats(verify=True)["invariants"] == "ok"
    assert other.stats()["owners"]["pins_released_at_end"] == 1
    assert not other.lookup(keys(2), "r").pending


def test_a_reservation_past_its_deadline_is_a_miss_and_its_late_commit_is_refused(
        make_cluster, instance):
    cluster = make_cluster(cpu={"num_blocks": 8}, broker={"reservation_s": 0.5})
    engine, other = cluster.client(), cluster.client()
    ks = keys(1, 2)
    reserved = engine.reserve(ks, "w")
    assert other.lookup(ks, "r").pending
    step_until(other, lambda: other.stats()["owners"]["reservations_withdrawn"] == 2)
    found = other.lookup(ks, "r")
    assert found.hits == 0 and not found.pending
    # The rows stay held for the late writer: nobody else is given them meanwhile.
    assert other.stats()["cpu"]["blocks_writing"] == 2
    write_rows(instance, ks, reserved.block_ids)
    with pytest.raises(RemoteError) as late:
        engine.commit(ks)
    assert late.value.code == "expired"
    assert other.lookup(ks, "r").hits == 0
    assert other.stats()["cpu"]["blocks_writing"] == 0  # freed by the late commit


def test_renewing_a_reservation_keeps_it(make_cluster):
    cluster = make_cluster(cpu={"num_blocks": 8}, broker={"reservation_s": 1.0})
    engine = cluster.client()
    first = engine.reserve(keys(1), "w")
    for _ in range(4):
        time.sleep(0.4)
        assert engine.reserve(keys(1), "w").block_ids == first.block_ids  # renewed
    engine.commit(keys(1))
    assert engine.lookup(keys(1), "r").hits == 1


def test_a_pin_past_its_deadline_is_released(make_cluster, instance):
    cluster = make_cluster(cpu={"num_blocks": 8}, broker={"pin_s": 0.5})
    engine = cluster.client()
    reserved = engine.reserve(keys(1), "w")
    write_rows(instance, keys(1), reserved.block_ids)
    engine.commit(keys(1))
    step_until(engine, lambda: settled(engine))
    engine.pin(keys(1), "r")
    step_until(engine, lambda: engine.stats()["owners"]["pins_expired"] == 1)
    with pytest.raises(RemoteError, match="expired"):
        engine.release(keys(1))
    assert engine.stats(verify=True)["invariants"] == "ok"


def test_one_client_cannot_take_more_than_its_share(make_cluster):
    cluster = make_cluster(cpu={"num_blocks": 8}, broker={"owner_share": 0.5})
    greedy, other = cluster.client(), cluster.client()
    assert greedy.reserve(keys(1, 2, 3, 4), "w").ok
    with pytest.raises(RemoteError) as over:
        greedy.reserve(keys(5), "w")
    assert over.value.code == "quota" and "broker.owner_share" in over.value.message
    assert other.reserve(keys(6, 7, 8), "w").ok  # room is left for the others


def test_a_bad_field_refuses_the_whole_message_and_applies_nothing(make_cluster, instance):
    """The whole message is checked first: a context with next_turn_s -5 got `fatal`
    after the message's commits had run."""
    cluster = make_cluster(cpu={"num_blocks": 8})
    engine = cluster.client()
    reserved = engine.reserve(keys(1), "w")
    write_rows(instance, keys(1), reserved.block_ids)
    batch = engine.batch().commit(keys(1)).context(RequestContext("r", next_turn_s=-5.0))
    with pytest.raises(RemoteError) as bad:
        batch.lookup(keys(1), "r").send()
    assert bad.value.code == "bad_request" and "contexts[0].next_turn_s" in bad.value.message
    assert engine.lookup(keys(1), "r").pending  # the commit was not applied
    engine.commit(keys(1))
    assert engine.lookup(keys(1), "r").hits == 1


def test_oversized_requests_are_refused_before_any_work_and_no_child_is_killed(make_cluster):
    """F6: one legal message stalled the broker past its peers' patience, and it
    fenced its own healthy children."""
    cluster = make_cluster(cpu={"num_blocks": 8})
    engine = cluster.client()
    with pytest.raises(RemoteError) as many:
        batch = engine.batch()
        for i in range(MAX_GROUPS + 1):
            batch.lookup(keys(i), f"r{i}")
        batch.send()
    assert many.value.code == "bad_request" and "groups exceeds the limit" in many.value.message
    at_the_limit = [i.to_bytes(8, "big") for i in range(MAX_STEP_KEYS)]
    for _ in range(5):  # the largest legal lookups, back to back
        assert engine.lookup(at_the_limit, "big").hits == 0
    stats = engine.stats()
    assert stats["broker"]["peers_fenced"] == 0 and stats["broker"]["peer_deaths"] == 0


def test_a_tier_process_replaced_before_its_death_was_noticed_leaves_no_blocks_behind(
        make_cluster):
    """Once, the replacement said hello before the broker noticed the death,
    and the broker went on counting the dead process's blocks (every promotion of them
    failed `not_found`). A hello for a slot ends the old member at once."""
    cluster = make_cluster(cpu={"num_blocks": 16},
                           broker={"heartbeat_s": 5.0, "job_timeout_s": 30.0})
    c = cluster.client()
    ks = keys(*range(6))
    cluster.fill(ks, list(range(6)))
    wait_for(c, {c.store(ks, list(range(6))).job_id})
    step_until(c, lambda: c.stats()["tiers"]["memory"]["blocks"] == 6 and settled(c))
    child = cluster.node.children["tier:memory:0"]
    old_pid = child.proc.pid
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(timeout=10)
    # Silence would be noticed only after 3 x 5 s; the supervisor restarts it first
    # (as `Supervisor.watch` does).
    cluster.node.spawn(next(s for s in cluster.node.specs() if s.name == "tier:memory:0"))
    step_until(c, lambda: [p["pid"] for p in c.stats()["peers"] if p["kind"] == "tier"]
               not in ([], [old_pid]), timeout=10)
    stats = c.stats()
    assert [p["pid"] for p in stats["peers"] if p["kind"] == "tier"] != [old_pid]
    assert stats["tiers"]["memory"]["blocks"] == 0  # what the live process holds


def test_a_tier_process_started_by_hand_joins_with_the_tier_secret(make_cluster, tmp_path):
    """A tier deployed as a process of its own (processes = 0) joins
    by proving the node's tier secret; one that cannot is refused."""
    cluster = make_cluster(cpu={"num_blocks": 16}, tiers=[
        {"type": "memory", "name": "byhand", "capacity_blocks": 64, "processes": 0}])
    c = cluster.client()
    config_file = cluster.config.run_path / "node.toml"
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("not-the-secret\n")
    wrong.chmod(0o600)
    stranger_config = tmp_path / "stranger.toml"
    text = config_file.read_text()
    assert 'tier_secret_file = ""' in text
    stranger_config.write_text(text.replace('tier_secret_file = ""',
                                            f'tier_secret_file = "{wrong}"'))
    procs = []
    try:
        for config in (stranger_config, config_file):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "workers.tier_worker", "--name", "byhand", "-c",
                 str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        stranger, by_hand = procs
        assert stranger.wait(timeout=30) != 0  # refused: it exits, saying why
        assert "tier secret" in stranger.stderr.read()
        step_until(c, lambda: any(p["kind"] == "tier" and p["pid"] == by_hand.pid
                                  for p in c.stats()["peers"]), timeout=30)
        ks = keys(1, 2, 3)
        cluster.fill(ks, [0, 1, 2])
        wait_for(c, {c.store(ks, [0, 1, 2]).job_id})
        step_until(c, lambda: c.stats()["tiers"]["byhand"]["blocks"] == 3)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stderr is not None:
                proc.stderr.close()


def test_a_broker_that_stalled_kills_none_of_its_healthy_children(make_cluster):
    """Silence is measured from the broker's side of the loop. A
    broker stopped for longer than its peers' heartbeat budget used to find every peer
    silent when it resumed, and fenced (SIGKILLed) its own healthy children."""
    cluster = make_cluster(cpu={"num_blocks": 8})
    c = cluster.client()
    before = {name: child.proc.pid for name, child in cluster.node.children.items()}
    broker = cluster.node.children["broker"].proc
    broker.send_signal(signal.SIGSTOP)
    try:
        time.sleep(8 * cluster.config.broker.heartbeat_s)  # the broker is not listening
    finally:
        broker.send_signal(signal.SIGCONT)
    step_until(c, lambda: sum(p["state"] == "ready" for p in c.stats()["peers"]) == 2)
    stats = c.stats()
    assert stats["broker"]["peers_fenced"] == 0
    assert all(child.proc.poll() is None for child in cluster.node.children.values())
    assert {name: child.proc.pid for name, child in cluster.node.children.items()} == before
    ks = keys(1, 2)
    cluster.fill(ks, [0, 1])
    wait_for(c, {c.store(ks, [0, 1]).job_id})  # and the node serves on


def test_a_whole_node_stalled_past_a_jobs_deadline_kills_no_child(make_cluster):
    """The broker's own stall also moves its view of job deadlines: a worker stopped
    with a job, then the broker with it past `job_timeout_s` (a stalled machine), was
    fenced when both resumed, though it would fail the late job itself."""
    cluster = make_cluster(cpu={"num_blocks": 8}, broker={"job_timeout_s": 2.0})
    c = cluster.client()
    worker = cluster.node.children["worker0"].proc
    broker = cluster.node.children["broker"].proc
    ks = keys(1, 2)
    cluster.fill(ks, [0, 1])
    worker.send_signal(signal.SIGSTOP)
    try:
        store = c.store(ks, [0, 1])
        time.sleep(0.2)
        broker.send_signal(signal.SIGSTOP)
        time.sleep(3 * cluster.config.broker.job_timeout_s)
    finally:
        broker.send_signal(signal.SIGCONT)
        worker.send_signal(signal.SIGCONT)
    result = wait_for(c, {store.job_id}, timeout=30)[store.job_id]  # failed or not: ends
    assert c.stats()["broker"]["peers_fenced"] == 0
    assert worker.poll() is None and broker.poll() is None
    if not result.success:
        wait_for(c, {c.store(ks, [0, 1]).job_id})  # and the node serves on


def test_rows_reserved_ahead_become_the_blocks_written_into_them(make_cluster, instance):
    """A client reserves rows under keys of its own (so a store needs no round trip)
    and says at the end what it wrote: each row is its key's block, unless the key was
    there already (the row is freed); another client cannot say it for it."""
    cluster = make_cluster(cpu={"num_blocks": 8})
    engine, other = cluster.client(), cluster.client()
    spares = [b"spare-" + bytes([i]) * 10 for i in range(3)]
    rows = engine.reserve(spares).block_ids
    present = keys(9)
    other.reserve(present, "w")
    other.commit(present)
    wanted = keys(1, 2)
    with pytest.raises(RemoteError, match="not_owner"):
        other.commit_as(spares[:2], wanted)
    write_rows(instance, [*wanted, present[0]], rows)
    assert engine.commit_as(spares, [*wanted, present[0]]) == [True, True, False]
    found = other.lookup([*wanted, *present], "r", pin=True)
    assert found.hits == 3 and found.rows[:2] == rows[:2]
    assert read_rows(instance, found.rows[:2]) == [key_bytes(k, 0, 1024) for k in wanted]
    other.release([*wanted, *present])
    stats = other.stats(verify=True)
    assert stats["invariants"] == "ok" and stats["cpu"]["blocks_writing"] == 0
    assert stats["cpu"]["blocks_free"] == 8 - 3  # the duplicate's row went back
    with pytest.raises(RemoteError, match="not_owner"):
        engine.commit_as(spares[:1], keys(5))  # ended already
