"""The S3 tier against a real HTTP endpoint (a local moto server, one per module):
configuration and credentials, the start-up probe, the object format and its
verification, retries, the circuit breaker, budget, inventory and gc."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import boto3
import pytest
from botocore.config import Config as BotoConfig

from tests.tiers.fixtures_s3 import (  # noqa: F401 - fixtures
    TEST_ENV,
    FlakyEndpoint,
    fixture_make_s3,
    fixture_s3_entry,
    fixture_s3_server,
    unique_bucket,
)
from tierkv.core.blockformat import HEADER_SIZE, unpack_header
from tierkv.core.errors import ErrorCode, TierError
from tierkv.node.s3auth import KeyPair
from tierkv.node.s3server import S3Server, check_loopback
from tierkv.tiers.registry import TierConfigError, create_backend
from workers.s3.backend import S3Backend
from workers.s3.body import BlockBody, body_reader
from workers.s3.breaker import CircuitBreaker
from workers.s3.gc import gc, main, parse_age

BLOCK = 4096


def key(n: int) -> bytes:
    return b"key-" + n.to_bytes(4, "big")


def payload(n: int, size: int = BLOCK) -> bytes:
    return (os.urandom(12) + n.to_bytes(4, "big")) * (size // 16)


def raw_client(endpoint_url: str) -> Any:
    """A plain boto3 client: the test's hands on the bucket, behind the tier's back."""
    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1",
                        aws_access_key_id=TEST_ENV["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=TEST_ENV["AWS_SECRET_ACCESS_KEY"],
                        config=BotoConfig(s3={"addressing_style": "path"}))


def entry_options(s3_entry: dict[str, Any], **over: Any) -> dict[str, Any]:
    options = {k: v for k, v in s3_entry.items() if k != "type"}
    options.update(over)
    return options


@pytest.fixture
def flaky(s3_server):
    endpoint = FlakyEndpoint(s3_server.endpoint_url).up()
    yield endpoint
    endpoint.close()


# -- pure parts ------------------------------------------------------------------------


def test_breaker_opens_after_failures_and_closes_after_a_good_trial():
    now = [0.0]
    breaker = CircuitBreaker(failures=3, cooldown_s=5.0, clock=lambda: now[0])
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state == "closed"
    breaker.success()  # a success resets the count
    for _ in range(3):
        breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    now[0] = 4.9
    assert not breaker.allow()
    now[0] = 5.0
    assert breaker.allow()  # the one trial
    assert breaker.state == "half_open" and not breaker.allow()
    breaker.failure()  # the trial failed: open again, for a full cool-down
    assert breaker.state == "open" and not breaker.allow()
    now[0] = 10.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()
    assert breaker.stats() == {"breaker": "closed", "breaker_opens": 2,
                               "consecutive_failures": 0, "breaker_retry_in_s": 0.0}


def test_block_body_streams_both_parts_without_copying():
    row = bytearray(b"p" * 100)
    body = BlockBody(b"H" * 10, memoryview(row))
    assert len(body) == 110 and body.seekable()
    first = body.read(16)
    assert bytes(first) == b"H" * 10  # a read never spans the two parts
    chunk = body.read(16)
    row[0] = ord("X")
    assert isinstance(chunk, memoryview) and bytes(chunk)[0] == ord("X")  # a view of the row
    body.seek(0)
    assert b"".join(bytes(c) for c in iter(lambda: body.read(7), b"")) == b"H" * 10 + bytes(row)
    assert body.seek(-5, io.SEEK_END) == 105 and bytes(body.read()) == b"p" * 5
    body.close()
    with pytest.raises(ValueError):
        body.read(1)


def test_parse_age_and_loopback_only():
    assert parse_age("90") == 90 and parse_age("15m") == 900 and parse_age("7d") == 7 * 86400
    with pytest.raises(Exception, match="not an age"):
        parse_age("soon")
    assert check_loopback("::1") == "::1"
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("0.0.0.0")
    with pytest.raises(ValueError, match="loopback"):
        S3Server(host="10.0.0.1")


def test_local_endpoint_leaves_no_process_behind_when_its_owner_dies():
    """The moto child holds a lifeline to its owner: a SIGKILLed owner leaves no orphan."""
    owner = subprocess.Popen(
        [sys.executable, "-c", "import time; from tierkv.node.s3server import S3Server; "
         "s = S3Server().start(); print(s.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        child = int(owner.stdout.readline())
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, f"orphaned endpoint pid {child}"
            time.sleep(0.05)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        owner.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# -- configuration and start-up -------------------------------------------------------


def test_inline_secret_is_refused_without_echoing_it(s3_entry):
    spec = {**s3_entry, "aws_secret_access_key": "inline-SECRET-value-123"}
    with pytest.raises(TierConfigError) as e:
        create_backend(spec, block_bytes=BLOCK, namespace="ns")
    assert "environment variable" in str(e.value)
    assert "inline-SECRET-value-123" not in str(e.value)
    with pytest.raises(TierConfigError, match="unknown option"):
        create_backend({**s3_entry, "secret_access_key": "x"}, block_bytes=BLOCK)


def test_credentials_from_named_environment_variables(s3_entry, monkeypatch):
    options = entry_options(s3_entry, access_key_id_env="KV_T_KEY",
                            secret_access_key_env="KV_T_SECRET")
    with pytest.raises(TierConfigError, match="KV_T_KEY.*not set"):
        S3Backend(block_bytes=BLOCK, **options)
    # The endpoint admits only its own key pair: the named variables hold it.
    monkeypatch.setenv("KV_T_KEY", TEST_ENV["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("KV_T_SECRET", TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    backend = S3Backend(block_bytes=BLOCK, **options)
    try:
        assert "KV_T_SECRET" in backend.stats()["credentials"]
        backend.store(key(1), memoryview(payload(1)))
        assert backend.exists(key(1))
    finally:
        backend.close()
    with pytest.raises(TierConfigError, match="both"):
        S3Backend(block_bytes=BLOCK, **entry_options(s3_entry, access_key_id_env="KV_T_KEY"))


def test_bad_options_are_one_clear_error(s3_entry):
    with pytest.raises(TierConfigError, match="bucket is required"):
        S3Backend(**entry_options(s3_entry, bucket=""))
    with pytest.raises(TierConfigError, match="addressing_style"):
        S3Backend(**entry_options(s3_entry, addressing_style="sideways"))


@pytest.mark.parametrize("option, value", [("namespace", "../other-tenant"),
                                           ("namespace", "model//fp16"),
                                           ("prefix", "tierkv/./x"),
                                           ("namespace", "model\nfp16")])
def test_prefix_and_namespace_cannot_leave_their_place(s3_entry, option, value):
    """Object names stay under `prefix/namespace/`, even for stores that resolve `..`."""
    with pytest.raises(TierConfigError, match=option):
        S3Backend(**entry_options(s3_entry, **{option: value}))


def test_missing_bucket_fails_the_start_naming_bucket_endpoint_and_cause(s3_server, s3_entry):
    bucket = unique_bucket("missing")
    with pytest.raises(TierError) as e:
        S3Backend(**entry_options(s3_entry, bucket=bucket, create_bucket=False))
    message = str(e.value)
    assert bucket in message and s3_server.endpoint_url in message
    assert "does not exist" in message and "create_bucket" in message


def test_wrong_endpoint_fails_the_start_fast(s3_entry, flaky):
    flaky.down()  # a loopback port nobody listens on
    t0 = time.monotonic()
    with pytest.raises(TierError) as e:
        S3Backend(**entry_options(s3_entry, endpoint_url=flaky.endpoint_url))
    assert time.monotonic() - t0 < 5
    assert flaky.endpoint_url in str(e.value) and "cannot be reached" in str(e.value)
    assert s3_entry["bucket"] in str(e.value)


def test_refused_credentials_fail_the_start(s3_server, s3_entry, monkeypatch):
    """The endpoint admits only its own key pair: another secret is refused."""
    bucket = unique_bucket("auth")
    monkeypatch.setenv("TIERKV_TEST_KEY", TEST_ENV["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("TIERKV_TEST_SECRET", "not-the-endpoint-secret")
    with pytest.raises(TierError) as e:
        S3Backend(**entry_options(s3_entry, bucket=bucket, access_key_id_env="TIERKV_TEST_KEY",
                                  secret_access_key_env="TIERKV_TEST_SECRET"))
    assert "credentials were refused" in str(e.value) and bucket in str(e.value)
    assert s3_server.endpoint_url in str(e.value)
    assert "not-the-endpoint-secret" not in str(e.value)


# -- objects ---------------------------------------------------------------------------


def test_object_name_and_body_are_the_block_format(make_s3, s3_server):
    backend = make_s3(BLOCK)
    data = payload(1)
    backend.store(key(1), memoryview(data))
    name = backend.object_name(key(1))
    assert name == f"tierkv/{backend.namespace}/{key(1).hex()}"
    body = raw_client(s3_server.endpoint_url).get_object(Bucket=backend.bucket, Key=name)
    raw = body["Body"].read()
    assert len(raw) == HEADER_SIZE + BLOCK and raw[HEADER_SIZE:] == data
    header = unpack_header(raw[:HEADER_SIZE])
    assert header.key == key(1) and header.namespace == backend.namespace.encode()


def test_get_reads_the_socket_straight_into_the_row(make_s3, s3_server):
    backend = make_s3(BLOCK)
    backend.store(key(1), memoryview(payload(1)))
    response = backend._data.get_object(Bucket=backend.bucket, Key=backend.object_name(key(1)))
    readinto, release = body_reader(response["Body"])
    assert readinto.__self__.__class__.__module__ == "http.client"  # no urllib3 copy
    out = bytearray(HEADER_SIZE + BLOCK)
    view, pos = memoryview(out), 0
    while pos < len(out):
        pos += readinto(view[pos:])
    release()
    # The connection went back to the pool and serves the next request.
    for _ in range(3):
        dst = bytearray(BLOCK)
        backend.load(key(1), memoryview(dst))
        assert bytes(dst) == bytes(out[HEADER_SIZE:])


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_key", "garbage"])
def test_corrupt_object_fails_the_load_is_deleted_and_counted(make_s3, s3_server, damage):
    backend = make_s3(BLOCK)
    backend.store(key(1), memoryview(payload(1)))
    backend.store(key(2), memoryview(payload(2)))
    raw = raw_client(s3_server.endpoint_url)
    name = backend.object_name(key(1))
    good = raw.get_object(Bucket=backend.bucket, Key=name)["Body"].read()
    bad = {
        "flip": good[:-1] + bytes([good[-1] ^ 1]),
        "truncate": good[: HEADER_SIZE + BLOCK // 2],
        "other_key": raw.get_object(Bucket=backend.bucket,
                                    Key=backend.object_name(key(2)))["Body"].read(),
        "garbage": os.urandom(len(good)),
    }[damage]
    raw.put_object(Bucket=backend.bucket, Key=name, Body=bad)
    with pytest.raises(TierError) as e:
        backend.load(key(1), memoryview(bytearray(BLOCK)))
    assert e.value.code is ErrorCode.CORRUPT
    assert backend.stats()["errors_corrupt"] == 1
    assert not backend.exists(key(1))  # the bad copy is gone
    assert backend.stats()["breaker"] == "closed"  # bad data is not a sick endpoint
    out = bytearray(BLOCK)
    backend.load(key(2), memoryview(out))  # the neighbour is untouched


def test_namespaces_do_not_see_each_other(make_s3, s3_entry):
    a = make_s3(BLOCK)
    b = make_s3(BLOCK)
    a.store(key(1), memoryview(payload(1)))
    assert a.exists(key(1)) and not b.exists(key(1))
    assert key(1) not in b.inventory()
    with pytest.raises(TierError) as e:
        b.load(key(1), memoryview(bytearray(BLOCK)))
    assert e.value.code is ErrorCode.NOT_FOUND


def test_a_second_node_on_the_same_bucket_finds_and_loads_the_block(make_s3):
    a = make_s3(BLOCK, inventory_limit=0)
    data = payload(7)
    a.store(key(7), memoryview(data))
    b = make_s3(BLOCK, namespace=a.namespace, inventory_limit=0)
    assert b.inventory() == []  # no listing: found by existence checks instead
    assert b.shared and b.exists(key(7))
    out = bytearray(BLOCK)
    b.load(key(7), memoryview(out))
    assert bytes(out) == data
    other_size = make_s3(BLOCK * 2, namespace=a.namespace)
    assert not other_size.exists(key(7))  # a block of another geometry is no hit


def test_inventory_lists_survivors_in_age_order_and_skips_strays(make_s3, s3_server):
    a = make_s3(BLOCK)
    for n in range(5):
        a.store(key(n), memoryview(payload(n)))
    raw = raw_client(s3_server.endpoint_url)
    prefix = f"tierkv/{a.namespace}/"
    raw.put_object(Bucket=a.bucket, Key=prefix + "README", Body=b"not a block")
    raw.put_object(Bucket=a.bucket, Key=prefix + "nested/" + key(9).hex(), Body=b"x")
    raw.put_object(Bucket=a.bucket, Key=prefix + key(8).hex(), Body=b"short")
    restarted = make_s3(BLOCK, namespace=a.namespace)
    assert sorted(restarted.inventory()) == sorted(key(n) for n in range(5))
    assert restarted.stats()["bytes"] == 5 * (HEADER_SIZE + BLOCK)
    capped = make_s3(BLOCK, namespace=a.namespace, inventory_limit=2)
    assert len(capped.inventory()) == 2


def test_budget_deletes_lru_objects_from_the_bucket(make_s3, s3_server):
    backend = make_s3(BLOCK, capacity_blocks=3)
    assert backend.capacity() == 3 * (HEADER_SIZE + BLOCK)
    for n in range(3):
        backend.store(key(n), memoryview(payload(n)))
    backend.load(key(0), memoryview(bytearray(BLOCK)))  # a load refreshes key 0
    backend.store(key(3), memoryview(payload(3)))
    assert backend.take_evicted() == [key(1)]
    listed = raw_client(s3_server.endpoint_url).list_objects_v2(
        Bucket=backend.bucket, Prefix=f"tierkv/{backend.namespace}/")
    names = {o["Key"] for o in listed["Contents"]}
    assert names == {backend.object_name(key(n)) for n in (0, 2, 3)}
    with pytest.raises(TierError) as e:
        backend.store(key(9), memoryview(payload(9)), pinned={key(0), key(2), key(3), key(9)})
    assert e.value.code is ErrorCode.NO_SPACE


def test_requests_are_bounded_by_max_concurrency(make_s3):
    backend = make_s3(BLOCK, max_concurrency=2)
    active, peak = [0], [0]
    lock = threading.Lock()
    put = backend._data.put_object

    def counting_put(**kwargs: Any) -> Any:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.02)
            return put(**kwargs)
        finally:
            with lock:
                active[0] -= 1

    backend._data.put_object = counting_put
    threads = [threading.Thread(target=backend.store, args=(key(n), memoryview(payload(n))))
               for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert peak[0] == 2
    assert all(backend.exists(key(n)) for n in range(8))


# -- faults ----------------------------------------------------------------------------


def test_dropped_connections_and_throttling_are_retried_inside_the_tier(make_s3, flaky):
    backend = make_s3(BLOCK, endpoint_url=flaky.endpoint_url, max_attempts=3)
    flaky.drop_next(1)
    backend.store(key(1), memoryview(payload(1)))
    flaky.throttle_next(1)
    out = bytearray(BLOCK)
    backend.load(key(1), memoryview(out))
    stats = backend.stats()
    assert stats["retries"] >= 1 and stats["errors"] == 0 and stats["breaker"] == "closed"
    impatient = make_s3(BLOCK, namespace=backend.namespace, endpoint_url=flaky.endpoint_url,
                        max_attempts=1)
    flaky.throttle_next(5)  # more than max_attempts: one final, retryable failure
    with pytest.raises(TierError) as e:
        impatient.load(key(1), memoryview(out))
    assert e.value.code is ErrorCode.RETRYABLE and "SlowDown" in e.value.message
    flaky.throttle_next(0)


def test_endpoint_down_opens_the_breaker_and_it_closes_when_back(make_s3, flaky):
    backend = make_s3(BLOCK, endpoint_url=flaky.endpoint_url, breaker_failures=2,
                      breaker_cooldown_s=0.5, max_attempts=1)
    backend.store(key(1), memoryview(payload(1)))
    flaky.down()
    for _ in range(2):
        with pytest.raises(TierError) as e:
            backend.store(key(2), memoryview(payload(2)))
        assert e.value.code is ErrorCode.UNAVAILABLE
    assert backend.stats()["breaker"] == "open"
    t0 = time.monotonic()
    with pytest.raises(TierError, match="circuit open"):
        backend.load(key(1), memoryview(bytearray(BLOCK)))
    assert not backend.exists(key(1))  # a lookup misses, at once
    assert time.monotonic() - t0 < 0.1
    assert backend.stats()["fast_fails"] == 2
    flaky.up()
    time.sleep(0.6)
    assert backend.exists(key(1))  # the trial succeeds
    assert backend.stats()["breaker"] == "closed" and backend.stats()["breaker_opens"] == 1


def test_hung_endpoint_is_a_miss_within_the_exists_timeout(make_s3, flaky):
    backend = make_s3(BLOCK, endpoint_url=flaky.endpoint_url, exists_timeout_s=0.3)
    backend.store(key(1), memoryview(payload(1)))
    backend.close()  # no warm connection: the next check connects to a hung endpoint
    backend = make_s3(BLOCK, namespace=backend.namespace, endpoint_url=flaky.endpoint_url,
                      exists_timeout_s=0.3)
    flaky.stall(True)
    t0 = time.monotonic()
    assert not backend.exists(key(1))
    assert time.monotonic() - t0 < 1.5
    flaky.stall(False)
    assert backend.exists(key(1))


# -- secrets ---------------------------------------------------------------------------


@pytest.fixture
def debug_logs():
    """tierkv's own logging setup at DEBUG, captured; restored afterwards."""
    from tierkv.node.logs import setup_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level,
             {n: logging.getLogger(n).level for n in ("botocore", "boto3", "urllib3",
                                                      "s3transfer")})
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    setup_logging("test", "debug")
    handler = Keep(logging.DEBUG)
    root.addHandler(handler)
    yield records
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def test_secrets_never_in_logs_errors_repr_or_stats(s3_entry, monkeypatch, debug_logs):
    secret, key_id = f"SeCrEt-{uuid.uuid4().hex}", f"AKID{uuid.uuid4().hex[:16].upper()}"
    monkeypatch.setenv("KV_SECRET_T", secret)
    monkeypatch.setenv("KV_KEY_T", key_id)
    # An endpoint of its own: it admits only its key pair, and this is the one.
    with S3Server(keys=KeyPair(key_id, secret)) as server:
        flaky = FlakyEndpoint(server.endpoint_url).up()
        try:
            seen, options = _use_and_fail(s3_entry, flaky, server)
        finally:
            flaky.close()
    with pytest.raises(TierError) as e:
        S3Backend(block_bytes=BLOCK, **{**options, "bucket": unique_bucket("nope")})
    seen.append(str(e.value))
    logged = "\n".join(debug_logs)
    assert "circuit open" in logged and "corrupt" in logged  # the logs did capture
    for text in [*seen, logged]:
        assert secret not in text and key_id not in text


def _use_and_fail(s3_entry: dict[str, Any], flaky: FlakyEndpoint,
                  server: S3Server) -> tuple[list[str], dict[str, Any]]:
    """Store, load, corrupt, and fail every way a backend can; what it said."""
    options = entry_options(s3_entry, access_key_id_env="KV_KEY_T", max_attempts=1,
                            secret_access_key_env="KV_SECRET_T", breaker_failures=2,
                            endpoint_url=flaky.endpoint_url, budget_bytes=2 * (HEADER_SIZE + BLOCK))
    seen: list[str] = []
    backend = S3Backend(block_bytes=BLOCK, namespace="ns", **options)
    try:
        for n in range(3):
            backend.store(key(n), memoryview(payload(n)))
        backend.load(key(2), memoryview(bytearray(BLOCK)))
        boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                     **server.boto_keys).put_object(
            Bucket=backend.bucket, Key=backend.object_name(key(2)), Body=b"junk")
        for probe in (lambda: backend.load(key(2), memoryview(bytearray(BLOCK))),
                      lambda: backend.load(key(9), memoryview(bytearray(BLOCK)))):
            with pytest.raises(TierError) as e:
                probe()
            seen.append(str(e.value))
        flaky.down()
        for _ in range(3):
            with pytest.raises(TierError) as e:
                backend.store(key(5), memoryview(payload(5)))
            seen.append(str(e.value))
        backend.exists(key(1))
        seen += [repr(backend), str(backend.stats())]
    finally:
        backend.close()
    return seen, options


# -- gc --------------------------------------------------------------------------------


def test_gc_removes_a_namespaces_objects_older_than_an_age(make_s3, s3_entry, tmp_path, capsys,
                                                           monkeypatch):
    old = make_s3(BLOCK)
    for n in range(3):
        old.store(key(n), memoryview(payload(n)))
    neighbour = make_s3(BLOCK)
    neighbour.store(key(0), memoryview(payload(0)))
    time.sleep(1.1)  # S3 times are whole seconds
    old.store(key(5), memoryview(payload(5)))
    listed = raw_client(s3_entry["endpoint_url"]).list_objects_v2(Bucket=old.bucket)["Contents"]
    newest = max(o["LastModified"] for o in listed)
    # "Now" is pinned just after the newest write, so the test needs no long sleeps.
    monkeypatch.setattr("workers.s3.backend._utcnow", lambda: newest + timedelta(seconds=0.5))
    entry = dict(s3_entry)
    assert gc(entry, old.namespace, older_than_s=1, dry_run=True) == 3
    assert all(old.exists(key(n)) for n in range(3))
    config = tmp_path / "tierkv.toml"
    config.write_text(f'namespace = "{old.namespace}"\n[[tiers]]\n'
                      + "".join(f"{k} = {_toml(v)}\n" for k, v in entry.items()))
    assert main(["-c", str(config), "--older-than", "1s"]) == 0
    assert "deleted 3 objects" in capsys.readouterr().out
    assert not any(old.exists(key(n)) for n in range(3)) and old.exists(key(5))
    assert neighbour.exists(key(0))  # another namespace is left alone
    assert gc(entry, old.namespace, older_than_s=0, dry_run=False) == 1


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)
