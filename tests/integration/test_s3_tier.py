"""The S3 tier in a real node: broker, CPU worker and an s3 tier process, talking
HTTP to a local moto server (one per module) on loopback. Node A (a node costs
seconds to start) is shared by the tests, which run in file order; its tier goes
through a fault injector and logs at DEBUG, and the last test searches everything
it said for the secret.

- blocks cascade to the bucket and come back through promotion, bytes equal;
- a corrupted object is detected, deleted and counted, and is a miss;
- two nodes (separate brokers and shared regions) share one bucket: a block that
  node A stored is a hit on node B through an existence check and a promotion;
- the endpoint going down fails jobs within their deadline, opens the breaker,
  and the breaker closes again when the endpoint is back;
- no secret reaches a log line, a stats reply, a command line or the node config.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config as BotoConfig

from tests.conftest import new_instance
from tests.integration.cluster import (
    Cluster,
    keys,
    leftovers,
    make_config,
    step_until,
    store_when_room,
    wait_for,
)
from tests.tiers.fixtures_s3 import FlakyEndpoint, s3_test_env, unique_bucket
from tierkv.client import Lookup
from tierkv.node.lifecycle import ChildFailed
from tierkv.node.s3auth import KeyPair
from tierkv.node.s3server import S3Server
from tierkv.node.supervisor import Node


def s3_tier(endpoint_url: str, bucket: str, **options: Any) -> dict[str, Any]:
    return {"type": "s3", "bucket": bucket, "endpoint_url": endpoint_url,
            "create_bucket": True, "threads": 4, "max_attempts": 2, "connect_timeout_s": 1.0,
            "read_timeout_s": 3.0, "exists_timeout_s": 1.0, "negative_ttl_s": 0.2, **options}


def raw_client(endpoint_url: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1",
                        aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
                        config=BotoConfig(s3={"addressing_style": "path"}))


def tier_stats(c: Any) -> dict[str, Any]:
    return c.stats()["tiers"]["s3"]


def breaker(c: Any) -> dict[str, Any]:
    """The s3 backend's own stats, as its tier process last reported them."""
    (backend,) = tier_stats(c)["backend"]
    return backend


def cascade(cluster: Cluster, c: Any, block_keys: list[bytes], gpu_blocks: list[int]) -> None:
    """Store into the CPU tier and wait until the s3 tier holds the blocks too."""
    before = tier_stats(c)["stores"]
    cluster.fill(block_keys, gpu_blocks)
    store = store_when_room(c, block_keys, gpu_blocks, req_id="w")
    assert wait_for(c, {store.job_id})[store.job_id].success
    step_until(c, lambda: tier_stats(c)["stores"] >= before + len(block_keys), timeout=15)


def promote(cluster: Cluster, c: Any, block_keys: list[bytes], gpu_blocks: list[int],
            req_id: str) -> None:
    """Lookup until every key is a CPU hit (through promotion), then load to the GPU."""
    step_until(c, lambda: c.lookup(block_keys, req_id).hits == len(block_keys), timeout=15)
    cluster.scramble(gpu_blocks)
    load = c.load(block_keys, gpu_blocks, req_id=req_id)
    assert wait_for(c, {load.job_id})[load.job_id].success
    assert cluster.holds(block_keys, gpu_blocks)


SECRET = f"SeCrEt-{uuid.uuid4().hex}"
KEY_ID = f"AKIT{uuid.uuid4().hex[:16].upper()}"
CREDENTIALS = {"access_key_id_env": "TIERKV_IT_KEY", "secret_access_key_env": "TIERKV_IT_SECRET"}


def start_node(tmp_path_factory: Any, instance: str, tiers: list[dict[str, Any]],
               **sections: Any) -> tuple[Cluster, Path]:
    run_dir = tmp_path_factory.mktemp("run")
    config = make_config(instance, run_dir, cpu={"num_blocks": 8}, tiers=tiers,
                         namespace="it-model/fp16", log_level="debug",
                         supervisor={"log_lines": 50_000}, **sections)
    cluster = Cluster(config, 32)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster, run_dir


@pytest.fixture(scope="module", name="s3_server")
def fixture_s3_server() -> Any:
    """This module's endpoint: it admits only the key pair the nodes here read from
    named variables (and the AWS chain, for a tier entry that names none)."""
    with s3_test_env(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        with S3Server(keys=KeyPair(KEY_ID, SECRET), ready_timeout_s=30) as server:
            yield server


@pytest.fixture(scope="module")
def flaky(s3_server):
    endpoint = FlakyEndpoint(s3_server.endpoint_url).up()
    yield endpoint
    endpoint.close()


@pytest.fixture(scope="module")
def bucket() -> str:
    return unique_bucket("it")


@pytest.fixture(scope="module")
def node_a(tmp_path_factory, flaky, bucket):
    """Node A, shared by this module's tests (a node costs seconds to start): its s3
    tier talks to the bucket through a fault injector, with credentials from named
    environment variables, logging at DEBUG; every line is kept for the secret check."""
    instance = new_instance()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERKV_IT_KEY", KEY_ID)
        mp.setenv("TIERKV_IT_SECRET", SECRET)
        tier = s3_tier(flaky.endpoint_url, bucket, breaker_failures=2, breaker_cooldown_s=1.0,
                       max_attempts=1, **CREDENTIALS)
        cluster, run_dir = start_node(tmp_path_factory, instance, [tier])
        try:
            yield cluster
        finally:
            cluster.stop()
    assert leftovers(run_dir, instance) == []


def test_blocks_cascade_to_the_bucket_and_come_back(node_a, s3_server, bucket):
    c = node_a.client()
    first, second = keys(*range(8)), keys(*range(100, 108))
    cascade(node_a, c, first, list(range(8)))
    names = {o["Key"] for o in raw_client(s3_server.endpoint_url).list_objects_v2(
        Bucket=bucket, Prefix="tierkv/it-model/fp16/")["Contents"]}
    assert names == {f"tierkv/it-model/fp16/{k.hex()}" for k in first}
    node_a.fill(second, list(range(8, 16)))
    wait_for(c, {c.store(second, list(range(8, 16))).job_id})  # evicts `first` from CPU
    assert c.lookup(first[:4], "r1").hits == 0
    promote(node_a, c, first[:4], [20, 21, 22, 23], "r1")
    assert tier_stats(c)["loads"] >= 4
    c.finish("r1")


def test_corrupted_object_is_detected_deleted_and_a_miss(node_a, s3_server, bucket):
    c = node_a.client()
    ks = keys(200, 201)
    cascade(node_a, c, ks, [0, 1])
    # Evict `ks` from the CPU tier; wait for the cascade, so that promotions find
    # blocks without readers to evict.
    cascade(node_a, c, keys(*range(300, 308)), list(range(8, 16)))
    raw = raw_client(s3_server.endpoint_url)
    name = f"tierkv/it-model/fp16/{ks[0].hex()}"
    good = raw.get_object(Bucket=bucket, Key=name)["Body"].read()
    raw.put_object(Bucket=bucket, Key=name, Body=good[:-1] + bytes([good[-1] ^ 0xFF]))
    step_until(c, lambda: not c.lookup([ks[0]], "r2").pending, timeout=15)
    stats = tier_stats(c)
    assert stats["failures"].get("corrupt", 0) == 1 and stats["loads_failed"] >= 1
    step_until(c, lambda: breaker(c)["errors_corrupt"] == 1, timeout=5)  # the tier's own count
    assert c.lookup([ks[0]], "r2").hits == 0
    assert "Contents" not in raw.list_objects_v2(Bucket=bucket, Prefix=name)
    promote(node_a, c, [ks[1]], [24], "r2")  # its neighbour is intact
    c.finish("r2")


def test_two_nodes_share_one_bucket(node_a, tmp_path_factory, s3_server, bucket, monkeypatch):
    """Separate brokers and shared regions, one bucket: what A stored is a hit on B.
    B finds A's later blocks by its tier's background listing, within one
    `refresh_s`, and no lookup of B waits on an existence check (a HEAD
    per key per lookup made the demo's lookup p50 81 ms)."""
    ca = node_a.client()
    ks = keys(*range(40, 46))
    cascade(node_a, ca, ks, list(range(6)))
    monkeypatch.setenv("TIERKV_IT_KEY", KEY_ID)
    monkeypatch.setenv("TIERKV_IT_SECRET", SECRET)
    instance_b = new_instance()
    node_b, run_dir = start_node(tmp_path_factory, instance_b, [
        s3_tier(s3_server.endpoint_url, bucket, refresh_s=0.5, **CREDENTIALS)])
    try:
        cb = node_b.client()
        # B lists the bucket at start; keys stored after that are found by its listing.
        more = keys(50, 51)
        cascade(node_a, ca, more, [6, 7])
        first = cb.lookup(more, "rb")
        assert first.hits == 0  # answered at once: a miss until the listing finds them
        t0 = time.monotonic()
        step_until(cb, lambda: cb.lookup(more, "rb").pending or cb.lookup(more, "rb").hits,
                   timeout=5)
        assert time.monotonic() - t0 < 0.5 + 2.0  # one refresh interval, and a margin
        promote(node_b, cb, more + ks, list(range(10, 18)), "rb")
        stats = tier_stats(cb)
        assert stats["exists_checks"] == 0 and stats["loads"] == len(more + ks)
        assert stats["stores"] == 0
        # A key nobody stored is a miss at once.
        assert cb.lookup(keys(999), "rx") == Lookup(0, False)
        assert_no_secret(node_b)
    finally:
        node_b.stop()
    assert leftovers(run_dir, instance_b) == []


def test_without_a_listing_only_the_first_unknown_key_is_checked(node_a, tmp_path_factory,
                                                                 s3_server, bucket,
                                                                 monkeypatch):
    """`refresh_s = 0`: an unknown key is asked about, but only the first of a
    request's run, and the lookup answers `retry` meanwhile instead of waiting."""
    ca = node_a.client()
    ks = keys(*range(60, 64), prefix=b"r")
    cascade(node_a, ca, ks, [0, 1, 2, 3])
    monkeypatch.setenv("TIERKV_IT_KEY", KEY_ID)
    monkeypatch.setenv("TIERKV_IT_SECRET", SECRET)
    instance_c = new_instance()
    node_c, run_dir = start_node(tmp_path_factory, instance_c, [
        s3_tier(s3_server.endpoint_url, bucket, refresh_s=0.0, inventory_limit=0,
                **CREDENTIALS)])
    try:
        cc = node_c.client()
        first = cc.lookup(ks, "rc")
        assert first.hits == 0 and first.retry  # asking about ks[0], not waiting
        cc.step()
        promote(node_c, cc, ks, [10, 11, 12, 13], "rc")
        # One check per key, each asked only when the run reached it.
        assert tier_stats(cc)["exists_checks"] == len(ks)
    finally:
        node_c.stop()
    assert leftovers(run_dir, instance_c) == []


def test_endpoint_down_fails_jobs_in_time_and_the_breaker_recovers(node_a, flaky):
    c = node_a.client()
    cascade(node_a, c, keys(60), [0])
    flaky.down()
    try:
        t0 = time.monotonic()
        failed = tier_stats(c)["stores_failed"]
        node_a.fill(keys(61, 62, 63), [1, 2, 3])
        wait_for(c, {store_when_room(c, keys(61, 62, 63), [1, 2, 3]).job_id})
        step_until(c, lambda: tier_stats(c)["stores_failed"] >= failed + 3, timeout=10)
        assert time.monotonic() - t0 < node_a.config.broker.job_timeout_s
        step_until(c, lambda: breaker(c)["breaker"] == "open", timeout=5)
        # While open, a lookup of an unknown key is a quick miss, never a hang.
        t0 = time.monotonic()
        step_until(c, lambda: not c.lookup(keys(77), "r").pending, timeout=5)
        assert time.monotonic() - t0 < 2.0
    finally:
        flaky.up()
    # After the cool-down the next request is the trial; it closes the breaker.
    probes = iter(range(1000, 10**6))

    def store_probe() -> bool:
        key = keys(next(probes))
        node_a.fill(key, [5])
        c.store(key, [5])
        return breaker(c)["breaker"] == "closed"

    step_until(c, store_probe, timeout=10)
    assert breaker(c)["breaker_opens"] >= 1
    cascade(node_a, c, keys(64), [4])


def test_an_unreachable_tier_settles_to_a_miss_and_is_not_hammered(node_a, flaky):
    """With the endpoint down, every lookup of a key held only by the S3
    tier started a new promotion (an outage of a few seconds: ~1,000 failed jobs)."""
    c = node_a.client()
    held = keys(*range(400, 404))
    cascade(node_a, c, held, [0, 1, 2, 3])
    cascade(node_a, c, keys(*range(410, 418)), list(range(8, 16)))  # evicts `held`
    started = c.stats()["tiering"]["promotions_started"]
    flaky.down()
    try:
        t0 = time.monotonic()
        answers = []
        while time.monotonic() - t0 < 3.0:  # an engine asking at every step
            answers.append(c.lookup(held, "outage"))
            c.step()
            time.sleep(0.01)
        assert len(answers) > 100 and all(a.hits == 0 for a in answers)
        # A miss within one job deadline, then a retry only now and then (the back-off
        # doubles while the tier keeps failing; the breaker's trial after its cool-down).
        assert not answers[-1].pending or not answers[-2].pending
        misses = sum(not a.pending for a in answers)
        assert misses >= 0.8 * len(answers), (misses, len(answers))
        promotions = c.stats()["tiering"]["promotions_started"] - started
        assert promotions <= 3 * len(held), promotions
    finally:
        flaky.up()
    c.finish("outage")
    # The endpoint is back: once the back-off and the breaker's cool-down are over,
    # the blocks come back from S3 again.
    promote(node_a, c, held, [20, 21, 22, 23], "after")
    c.finish("after")


def test_no_secret_in_logs_stats_command_lines_or_config(node_a):
    """Runs last: node A's DEBUG logs now hold every path above, failures included."""
    assert_no_secret(node_a, expect=("corrupt", "circuit open"))


def assert_no_secret(cluster: Cluster, expect: tuple[str, ...] = ()) -> None:
    everything = [str(cluster.client().stats()), cluster.node.config_path.read_text()]
    for child in cluster.node.children.values():
        everything.append("\n".join(child.log_lines))
        everything.append(Path(f"/proc/{child.pid}/cmdline").read_bytes().decode(errors="replace"))
    text = "\n".join(everything)
    assert "TIERKV_IT_SECRET" in text  # the captured text is the real thing
    for word in expect:
        assert word in text
    assert SECRET not in text and KEY_ID not in text


@pytest.mark.slow
def test_missing_bucket_fails_the_node_start_with_one_sentence(instance, tmp_path, s3_server):
    bucket = unique_bucket("absent")
    config = make_config(instance, tmp_path, tiers=[
        {"type": "s3", "bucket": bucket, "endpoint_url": s3_server.endpoint_url}])
    node = Node(config)
    try:
        with pytest.raises(ChildFailed) as e:
            node.start()
    finally:
        node.stop()
    assert (f"cannot use bucket '{bucket}' at {s3_server.endpoint_url}: the bucket does not "
            f"exist" in str(e.value))
    assert leftovers(tmp_path, instance) == []
