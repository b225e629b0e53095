"""One node, engines coming and going: greedy output token for token the same as an
engine without offloading's, on a second pass, in a new engine process, with two
engines at once, after the node restarted (hits from disk), beside an engine of
another layout, after an engine was killed with stores in flight; and a CPU tier
filled with random bytes must break it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.conftest import new_instance
from tests.engine.harness import (
    BLOCK,
    MAX_TOKENS,
    RUN_S,
    EngineNode,
    describe,
    engine_config,
    hits,
    identical,
    managed_node,
    node_delta,
)
from tierkv.demo.vllm_workload import chats, documents, mixed

# 6 documents of 5 blocks, 2 questions each, and 4 conversations of 3 turns sharing a
# system prompt: about 70 blocks, against 40 in the engine's own cache.
WORKLOAD = mixed(documents(6, 5, 2, seed=1), chats(4, 3, seed=1))
# The same documents asked new questions, and new conversations.
SECOND = mixed(documents(6, 5, 1, seed=1, question_seed=2), chats(4, 2, seed=2, tag="d"))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    yield from managed_node(new_instance(), tmp_path_factory.mktemp("reuse"),
                            cpu_blocks=256, disk_blocks=1024)


class Story:
    """The module's engines, kept from one test to the next."""

    engines: dict[str, Any] = {}


def run(engine, rounds, node: EngineNode, reset: bool = False) -> tuple[dict, dict]:
    before = node.stats()
    result = engine.run(rounds, MAX_TOKENS, reset_device_cache=reset, timeout_s=RUN_S)
    engine.settle()  # what the connector owes goes out: the last stores are committed
    return result, node_delta(before, node.stats())


def test_a_second_pass_is_served_by_the_cpu_tier(node, engines, references, say):
    reference = references.outputs(WORKLOAD)
    engine = engines.start(engine_config(references.model("A"), "A", node), "first")
    Story.engines["first"] = engine
    first, _ = run(engine, WORKLOAD, node)
    # vLLM's own cache emptied: every reused block must come from tierkv.
    second, delta = run(engine, WORKLOAD, node, reset=True)
    say(describe("first pass", first, reference))
    say(describe("second pass", second, reference, delta))
    assert identical(first, reference)[0] == identical(first, reference)[1]
    assert identical(second, reference)[0] == identical(second, reference)[1]
    assert hits(second)["host"] > 0


def test_a_new_engine_process_reads_what_the_first_stored(node, engines, references, say):
    reference = references.outputs(WORKLOAD)
    Story.engines.pop("first").stop()  # gone: what it stored stays
    engine = engines.start(engine_config(references.model("A"), "A", node), "second")
    Story.engines["second"] = engine
    result, delta = run(engine, WORKLOAD, node)
    say(describe("new engine process", result, reference, delta))
    same, total = identical(result, reference)
    assert same == total
    assert hits(result)["host"] > 0


def test_two_engines_share_one_node_at_once(node, engines, references, say):
    reference = references.outputs(SECOND)
    other = engines.start(engine_config(references.model("A"), "A", node), "third")
    Story.engines["third"] = other
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def serve(name: str) -> None:
        try:
            results[name] = Story.engines[name].run(SECOND, MAX_TOKENS, timeout_s=RUN_S)
        except BaseException as e:  # noqa: BLE001 (raised below, in the test's thread)
            errors.append(e)

    before = node.stats()
    threads = [threading.Thread(target=serve, args=(n,)) for n in ("second", "third")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RUN_S + 30)
    assert not any(t.is_alive() for t in threads), "an engine did not finish its run"
    if errors:
        raise errors[0]
    delta = node_delta(before, node.stats())
    for name in ("second", "third"):
        say(describe(f"two at once, engine {name}", results[name], reference, delta))
    for name in ("second", "third"):
        same, total = identical(results[name], reference)
        assert same == total, name
        assert hits(results[name])["host"] > 0, name


def test_a_restarted_node_serves_from_disk(node, engines, references, say):
    reference = references.outputs(WORKLOAD)
    for name in ("second", "third"):
        Story.engines.pop(name).stop()
    node.restart()  # the CPU tier starts empty; the disk tier keeps its blocks
    engine = engines.start(engine_config(references.model("A"), "A", node), "after-restart")
    Story.engines["after-restart"] = engine
    result, delta = run(engine, WORKLOAD, node)
    say(describe("after the node restarted", result, reference, delta))
    same, total = identical(result, reference)
    assert same == total
    # tierkv tells vLLM where a hit came from only in its key-by-key lookups (a model
    # with a sliding window): here the node's count says which blocks disk served.
    assert delta["disk_promoted"] > 0
    assert hits(result)["host"] + hits(result)["disk"] > 0


def test_engines_of_two_layouts_never_read_each_others_blocks(node, engines, references, say):
    # Every document once, in one round: an engine can hit only what was stored
    # before the run. Layout A's blocks of them are in the node.
    docs = documents(6, 5, 1, seed=1, question_seed=3)
    a = Story.engines["after-restart"]
    a_result, _ = run(a, docs, node, reset=True)
    say(describe("layout A, stored documents", a_result, references.outputs(docs)))
    assert hits(a_result)["host"] + hits(a_result)["disk"] > 0

    reference_b = references.outputs(docs, "B")
    b = engines.start(engine_config(references.model("B"), "B", node), "layout-B")
    first, _ = run(b, docs, node)
    second, delta = run(b, docs, node, reset=True)
    say(describe("layout B, same documents (A's in the node)", first, reference_b))
    say(describe("layout B, its own blocks", second, reference_b, delta))
    assert identical(first, reference_b)[0] == identical(first, reference_b)[1]
    h = hits(first)
    assert h["host"] == h["disk"] == h["external_unspecified"] == 0  # not A's blocks
    assert identical(second, reference_b)[0] == identical(second, reference_b)[1]
    assert hits(second)["host"] > 0  # its own
    b.stop()
    again, _ = run(a, docs, node, reset=True)
    say(describe("layout A again, B's blocks beside its own", again, references.outputs(docs)))
    assert identical(again, references.outputs(docs))[0] == len(docs[0])
    assert hits(again)["host"] > 0


def test_a_corrupted_cpu_tier_breaks_the_output(node, references, say):
    """The negative control: the comparison catches KV that comes back wrong."""
    reference = references.outputs(WORKLOAD)
    engine = Story.engines["after-restart"]
    rows = node.corrupt_cpu_tier()
    result, delta = run(engine, WORKLOAD, node, reset=True)
    same, total = identical(result, reference)
    say(describe(f"CPU tier ({rows} rows) filled with random bytes", result, reference, delta))
    assert hits(result)["host"] > 0
    assert same < total


def test_a_connector_reset_with_copies_in_flight_lets_go_of_their_rows(node, say):
    """vLLM's weight-update path resets the connector too, often with copies in
    flight: their rows stay held until the workers report the flushed jobs, then are
    let go. vLLM 0.32 never tells the manager so, and they were held until the
    engine stopped: rows lost to the node at each reset, pinned or reserved (their
    blocks pending for every engine that had not reset)."""
    engine = Story.engines["after-restart"]
    fresh = documents(4, 3, 1, seed=7)  # nothing to load: vLLM resets no cache then
    reset = engine.reset(connector=True, prompts=[r["prompt"] for r in fresh[0]])
    after = engine.settle(steps=20)["tierkv"]
    say(f"connector reset mid-run: {reset['in_flight']} copies in flight, held at the node "
        f"after the run and 20 steps: {after}")
    assert reset["in_flight"] > 0  # the case this is about
    assert after == {"writing": 0, "pins": 0, "fenced": 0, "owed": 0}


def test_an_engine_killed_mid_store_leaves_no_wrong_kv_and_nothing_pending(
        node, engines, references, say):
    """An engine killed (no goodbye) with stores in flight leaves rows at the node
    reserved and half written. No engine may read them: another serving the same
    prompts meanwhile computes those blocks, token for token right. Nor may they stay
    pending: once the broker ends the silent owner (`broker.owner_timeout_s`) its
    reservations are aborted, and the blocks are stored and served again."""
    docs = documents(4, 3, 1, seed=11)  # new prompts: stores, nothing to load
    reference = references.outputs(docs)
    doomed = Story.engines.pop("after-restart")
    before = node.stats()["owners"]
    begun = doomed.begin([r["prompt"] for r in docs[0]])
    assert begun["in_flight"] > 0 and begun["tierkv"]["writing"] > 0  # the case
    doomed.kill()
    successor = engines.start(engine_config(references.model("A"), "A", node), "successor")
    meanwhile, _ = run(successor, docs, node)
    ended = _owner_ended(node, before, OWNER_END_S)
    again, _ = run(successor, docs, node, reset=True)  # computes what the dead held
    third, delta = run(successor, docs, node, reset=True)
    say(f"engine killed with {begun['in_flight']} stores in flight "
        f"({begun['tierkv']['writing']} blocks being written): owner ended, "
        f"{ended['reservations_aborted'] - before.get('reservations_aborted', 0)} "
        "reservations aborted")
    say(describe("another engine meanwhile", meanwhile, reference))
    say(describe("after the owner ended, third pass", third, reference, delta))
    for result in (meanwhile, again, third):
        same, total = identical(result, reference)
        assert same == total
    assert ended["reservations_aborted"] > before.get("reservations_aborted", 0)
    doc_tokens = 3 * BLOCK
    assert all(r["cached_tokens"] >= doc_tokens for r in third["rounds"][0])


OWNER_END_S = 60.0  # the node's broker.owner_timeout_s (30 s) and then some


def _owner_ended(node: EngineNode, before: dict[str, int], timeout_s: float
                 ) -> dict[str, int]:
    """The broker's owner counters once it has timed out one more owner."""
    deadline = time.monotonic() + timeout_s
    while True:
        owners = node.stats()["owners"]
        if owners.get("owners_timed_out", 0) > before.get("owners_timed_out", 0):
            return owners
        assert time.monotonic() < deadline, f"no owner ended within {timeout_s:.0f}s: {owners}"
        time.sleep(0.5)
