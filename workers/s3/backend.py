"""The S3 tier: one object per block in any S3-compatible store (AWS, MinIO, moto).

    [[tiers]]
    type = "s3"
    bucket = "kv-cache"
    endpoint_url = "http://127.0.0.1:9000"   # optional; default: AWS for `region`
    access_key_id_env = "KV_S3_KEY"          # optional; default: the AWS chain
    secret_access_key_env = "KV_S3_SECRET"
    budget_bytes = 500_000_000_000           # optional LRU budget
    threads = 16                             # tier I/O threads (framework key)

Objects are named `<prefix>/<namespace>/<key hex>` and hold the block format of
`tierkv.core.blockformat` (header + payload), verified on every load; a block that
fails verification fails its job, is deleted and is counted.

Decisions, and why:
- Credentials come from the AWS chain or from *named* environment variables, never
  from the config file (it is copied to the run directory and lands in backups);
  an inline secret is refused without echoing it. Nothing here logs, reprs or
  reports a secret; foreign error texts pass through `redact` first.
- Retries of throttling and connection errors are botocore's own (standard or
  adaptive mode: capped exponential backoff with jitter and a retry quota). On
  top of that a circuit breaker counts *final* failures: once open, jobs fail at
  once and existence checks miss, so a dead endpoint costs no deadlines; after the
  cool-down one trial request decides whether it closes again.
- Zero copy: a PUT streams a file-like object over [header, row memoryview] that
  hands out memoryview slices; a GET reads the socket straight into the row when
  urllib3 exposes its `http.client` response (else `readinto` through botocore).
  Payload signing and botocore's request checksums are off: the xxh3 in the
  header is verified end to end on every load, so a second pass over every block
  in Python would buy nothing.
- Inventory: the namespace prefix is listed at each hello, up to `inventory_limit`
  objects (0: no listing); anything beyond is still found by the broker's
  `exists` checks (the tier is `shared`). The listing also seeds the LRU used by
  `budget_bytes`, which each tier process enforces over the objects it knows.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Container, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, TypeVar

import botocore.exceptions as bexc

from tierkv.core.blockformat import HEADER_SIZE, CorruptBlock, pack_header, unpack_header, verify
from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.keys import OffloadKey
from tierkv.tiers.backend import TierBackend
from tierkv.tiers.lru import LRUIndex
from tierkv.tiers.registry import TierConfigError
from workers.s3.body import BlockBody, StreamBroken, body_reader, fill_from, flat_bytes
from workers.s3.breaker import CircuitBreaker
from workers.s3.connect import (
    AUTH_CODES,
    TRANSPORT_ERRORS,
    check_key_path,
    check_options,
    make_clients,
    open_session,
    safe_url,
    translate,
)
from workers.s3.options import OPTIONS

log = logging.getLogger("tierkv.s3")
T = TypeVar("T")

DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes



def _utcnow() -> datetime:
    return datetime.now(UTC)


class S3Backend(TierBackend):
    type_name: ClassVar[str] = "s3"
    shared: ClassVar[bool] = True
    options = OPTIONS  # the constructor's keyword arguments, checked before start

    def __init__(
        self,
        bucket: str = "",
        prefix: str = "tierkv",
        endpoint_url: str = "",
        region: str = "us-east-1",
        addressing_style: str = "auto",
        max_concurrency: int = 16,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        exists_timeout_s: float = 2.0,
        max_attempts: int = 4,
        retry_mode: str = "standard",
        access_key_id_env: str = "",
        secret_access_key_env: str = "",
        session_token_env: str = "",
        profile: str = "",
        create_bucket: bool = False,
        budget_bytes: int = 0,
        inventory_limit: int = 100_000,
        breaker_failures: int = 5,
        breaker_cooldown_s: float = 5.0,
        aws_access_key_id: object = None,
        aws_secret_access_key: object = None,
        aws_session_token: object = None,
        block_bytes: int = 0,
        namespace: str = "default",
        name: str = "s3",
    ) -> None:
        self.name = name
        inline = [n for n, v in (("aws_access_key_id", aws_access_key_id),
                                 ("aws_secret_access_key", aws_secret_access_key),
                                 ("aws_session_token", aws_session_token)) if v is not None]
        if inline:
            raise TierConfigError(
                f"s3 tier {name!r}: credentials are never read from the config file "
                f"({', '.join(inline)}); put them in environment variables and name those "
                f"with access_key_id_env / secret_access_key_env / session_token_env, or use "
                f"the AWS chain (environment, ~/.aws/credentials, instance role)"
            )
        check_options(name, bucket, addressing_style, retry_mode, max_concurrency, max_attempts,
                      budget_bytes)
        check_key_path(f"s3 tier {name!r}: prefix", prefix.strip("/"))
        check_key_path(f"s3 tier {name!r}: namespace", namespace)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.endpoint = safe_url(endpoint_url)
        self.region = region
        self.max_attempts = max_attempts
        self.budget_bytes = budget_bytes
        self.inventory_limit = inventory_limit
        self._ns_prefix = "/".join(p for p in (self.prefix, namespace) if p) + "/"
        self._breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        self._lru: LRUIndex[int] = LRUIndex(self._lock)  # key -> object bytes
        self._used = 0
        self._counters: dict[str, int] = dict.fromkeys(
            ("puts", "gets", "heads", "deletes", "bytes_put", "bytes_got", "retries",
             "errors", "errors_corrupt", "fast_fails", "evictions", "requests_in_flight"), 0)
        session, self._credential_source, self._secrets = open_session(
            name, f"bucket {bucket!r} at {self._where()}", region, access_key_id_env,
            secret_access_key_env, session_token_env, profile)
        self._data, self._probe = make_clients(
            session, endpoint_url, region, addressing_style, max_concurrency, connect_timeout_s,
            read_timeout_s, exists_timeout_s, max_attempts, retry_mode)
        try:
            self._check_bucket(create_bucket)
        except BaseException:
            self.close()
            raise
        log.info("s3 tier %s: bucket %s at %s, objects under %s, credentials from %s",
                 name, bucket, self._where(), self._ns_prefix, self._credential_source)

    # -- construction ------------------------------------------------------------------

    def _where(self) -> str:
        return self.endpoint or f"the AWS endpoint of region {self.region}"

    def _check_bucket(self, create: bool) -> None:
        """Fail the start with one sentence naming bucket, endpoint and cause."""
        what = f"s3 tier {self.name!r} cannot use bucket {self.bucket!r} at {self._where()}"
        try:
            self._probe.head_bucket(Bucket=self.bucket)
            return
        except bexc.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound") and create:
                self._create_bucket(what)
                return
            cause = (
                "the bucket does not exist (set create_bucket = true to create it)"
                if code in ("404", "NoSuchBucket", "NotFound")
                else "the credentials were refused (access denied)" if code in AUTH_CODES
                else f"the endpoint answered {code or 'an error'}"
            )
        except (bexc.NoCredentialsError, bexc.PartialCredentialsError):
            cause = "no complete AWS credentials were found"
        except bexc.ParamValidationError:
            cause = "the bucket name is not valid"
        except TRANSPORT_ERRORS as e:
            cause = f"the endpoint cannot be reached ({type(e).__name__})"
        raise TierError(ErrorCode.FATAL, f"{what}: {cause}")

    def _create_bucket(self, what: str) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            self._data.create_bucket(**kwargs)
            log.info("created bucket %s at %s", self.bucket, self._where())
        except bexc.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code != "BucketAlreadyOwnedByYou":  # another node was faster
                raise TierError(ErrorCode.FATAL, f"{what}: creating it failed ({code})") from e

    # -- requests ----------------------------------------------------------------------

    def object_name(self, key: OffloadKey) -> str:
        return self._ns_prefix + key.hex()

    def _key_of(self, name: str) -> OffloadKey | None:
        rest = name[len(self._ns_prefix):] if name.startswith(self._ns_prefix) else ""
        if not rest or len(rest) % 2 or len(rest) > 128 or not re.fullmatch(r"[0-9a-f]+", rest):
            return None  # not a block of this namespace (a nested namespace, a stray file)
        return bytes.fromhex(rest)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _call(self, op: str, key: OffloadKey | None, fn: Callable[[], T]) -> T:
        """One request (with botocore's retries) under a concurrency slot and the
        breaker; every failure leaves as a TierError with a redacted message."""
        if not self._breaker.allow():
            self._count("fast_fails")
            raise TierError(ErrorCode.UNAVAILABLE, (
                f"s3 endpoint {self._where()} is failing: circuit open, next try in "
                f"{self._breaker.retry_in():.1f}s"))
        with self._slots:
            self._count("requests_in_flight")
            try:
                result = fn()
            except Exception as e:
                error, unhealthy = self._translate(e, op, key)
                if unhealthy:
                    self._breaker.failure()
                else:
                    self._breaker.success()
                if error.code is not ErrorCode.NOT_FOUND:
                    self._count("errors")
                raise error from e
            finally:
                self._count("requests_in_flight", -1)
        self._breaker.success()
        if isinstance(result, dict):
            self._count("retries", result.get("ResponseMetadata", {}).get("RetryAttempts", 0))
        return result

    def _translate(self, e: Exception, op: str, key: OffloadKey | None) -> tuple[TierError, bool]:
        what = f"s3 {op} of {key.hex() if key else self.bucket} in bucket {self.bucket}"
        return translate(e, what, self._where(), self._secrets)

    # -- the backend -------------------------------------------------------------------

    def store(self, key: OffloadKey, src: memoryview, pinned: Container[OffloadKey] = ()) -> None:
        payload = flat_bytes(src)
        if self.block_bytes and len(payload) != self.block_bytes:
            raise TierError(ErrorCode.BAD_REQUEST,
                            f"block of {len(payload)} bytes, this tier stores {self.block_bytes}")
        size = HEADER_SIZE + len(payload)
        fresh, victims = self._reserve(key, size, pinned)
        for victim in victims:
            self._delete_object(victim, quiet=True)
        body = BlockBody(pack_header(key, self.namespace.encode(), payload, time.time_ns()),
                         payload)
        try:
            self._call("put", key, lambda: self._data.put_object(
                Bucket=self.bucket, Key=self.object_name(key), Body=body))
        except TierError:
            if fresh:
                self._forget(key)
            raise
        finally:
            body.close()
        self._count("puts")
        self._count("bytes_put", size)

    def _reserve(self, key: OffloadKey, size: int,
                 pinned: Container[OffloadKey]) -> tuple[bool, list[OffloadKey]]:
        """Account for `key` before it is written, choosing LRU victims outside
        `pinned` to stay within the budget. Returns (new key?, victims)."""
        with self._lock:
            if key in self._lru:
                self._used += size - self._lru[key]
                self._lru.put(key, size)
                return False, []
            victims: list[OffloadKey] = []
            if self.budget_bytes:
                if size > self.budget_bytes:
                    raise TierError(ErrorCode.NO_SPACE, "a block is larger than budget_bytes")
                candidates = iter([k for k in self._lru if k not in pinned and k != key])
                while self._used + size > self.budget_bytes:
                    victim = next(candidates, None)
                    if victim is None:
                        raise TierError(ErrorCode.NO_SPACE,
                                        "s3 tier budget is full of blocks in use")
                    self._used -= self._lru.evict(victim)
                    victims.append(victim)
                self._counters["evictions"] += len(victims)
            self._lru.put(key, size)
            self._used += size
            return True, victims

    def _forget(self, key: OffloadKey) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self._used -= size

    def load(self, key: OffloadKey, dst: memoryview) -> None:
        view = flat_bytes(dst)
        last: TierError | None = None
        for _ in range(self.max_attempts):  # botocore retries requests, not broken bodies
            try:
                self._call("get", key, lambda: self._get_into(key, view))
                break
            except StreamBroken as e:
                last = e
            except CorruptBlock as e:
                self._count("errors_corrupt")
                log.warning("s3 tier %s: object %s is corrupt (%s): deleting it", self.name,
                            self.object_name(key), e.message)
                self._delete_object(key, quiet=True)
                raise
        else:
            assert last is not None
            raise last
        self._count("gets")
        self._count("bytes_got", HEADER_SIZE + len(view))
        self.touch([key])

    def _get_into(self, key: OffloadKey, view: memoryview) -> None:
        response = self._data.get_object(Bucket=self.bucket, Key=self.object_name(key))
        body = response["Body"]
        readinto, release = body_reader(body)
        complete = False
        header = bytearray(HEADER_SIZE)
        try:
            size, want = response.get("ContentLength"), HEADER_SIZE + len(view)
            if size != want:
                raise CorruptBlock(f"object is {size} bytes, a block is {want}")
            try:
                fill_from(readinto, memoryview(header))
                fill_from(readinto, view)
            except TRANSPORT_ERRORS as e:
                raise StreamBroken(f"reading the body failed ({type(e).__name__})") from e
            complete = True
        finally:
            (release if complete else body.close)()
        verify(unpack_header(memoryview(header)), key, self.namespace.encode(), view)

    def exists(self, key: OffloadKey) -> bool:
        """A bounded `head_object` (probe client: short timeouts, no retries). A
        failed, slow or breaker-refused check is a miss, never a hang."""
        if not self._breaker.allow():
            self._count("fast_fails")
            return False
        self._count("heads")
        try:
            with self._slots:
                head = self._probe.head_object(Bucket=self.bucket, Key=self.object_name(key))
        except Exception as e:
            error, unhealthy = self._translate(e, "head", key)
            if unhealthy:
                self._breaker.failure()
                self._count("errors")
                log.debug("exists check of %s failed: %s", key.hex(), error.message)
            else:
                self._breaker.success()
            return False
        self._breaker.success()
        size = head.get("ContentLength")
        return not self.block_bytes or size == HEADER_SIZE + self.block_bytes

    def delete(self, key: OffloadKey) -> None:
        self._forget(key)
        self._delete_object(key)

    def _delete_object(self, key: OffloadKey, quiet: bool = False) -> None:
        try:
            self._call("delete", key, lambda: self._data.delete_object(
                Bucket=self.bucket, Key=self.object_name(key)))
            self._count("deletes")
        except TierError as e:
            if not quiet:
                raise
            # The object lingers: the broker forgets it anyway, `gc` removes it later.
            log.warning("s3 tier %s: could not delete %s: %s", self.name,
                        self.object_name(key), e.message)

    def inventory(self) -> list[OffloadKey]:
        if self.inventory_limit > 0:
            listed = sorted(self._list(self.inventory_limit), key=lambda o: o[2])
            with self._lock:
                mine = list(self._lru.items())  # what we stored ourselves is the newest
                self._lru.clear()
                for k, size, _ in listed:
                    self._lru[k] = size
                for k, size in mine:
                    self._lru.put(k, size)
                self._used = sum(self._lru.values())
        with self._lock:
            return list(self._lru)

    def _list(self, limit: int) -> Iterator[tuple[OffloadKey, int, datetime]]:
        """(key, size, last modified) of this namespace's blocks, at most `limit`."""
        want = HEADER_SIZE + self.block_bytes if self.block_bytes else None
        seen = 0
        for obj in self._objects():
            key = self._key_of(obj["Key"])
            if key is None or (want is not None and obj["Size"] != want):
                continue
            if seen >= limit:
                log.warning("s3 tier %s: more than %d objects under %s; the rest is found "
                            "by existence checks (raise inventory_limit to list more)",
                            self.name, limit, self._ns_prefix)
                return
            seen += 1
            yield key, obj["Size"], obj["LastModified"]

    def _objects(self) -> Iterator[dict[str, Any]]:
        pages = self._data.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._ns_prefix)
        try:
            for page in pages:
                yield from page.get("Contents", ())
        except Exception as e:
            raise self._translate(e, "list", None)[0] from e

    def capacity(self) -> int | None:
        return self.budget_bytes or None

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self._lru.touch(keys)

    def take_evicted(self) -> list[OffloadKey]:
        return self._lru.take_evicted()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self._counters)
            held = {"objects": len(self._lru), "bytes": self._used}
        return {"type": self.type_name, "bucket": self.bucket, "prefix": self._ns_prefix,
                "endpoint": self._where(), "region": self.region,
                "credentials": self._credential_source, "budget_bytes": self.budget_bytes,
                **held, **counters, **self._breaker.stats()}

    def collect_garbage(self, older_than_s: float, dry_run: bool = False) -> int:
        """Delete this namespace's blocks last written more than `older_than_s` ago
        (by the store's clock). Returns how many were (or would be) deleted."""
        cutoff = _utcnow() - timedelta(seconds=older_than_s)
        batch: list[str] = []
        count = 0
        for obj in self._objects():
            if self._key_of(obj["Key"]) is None or obj["LastModified"] >= cutoff:
                continue
            batch.append(obj["Key"])
            if len(batch) == DELETE_BATCH:
                count += self._delete_batch(batch, dry_run)
                batch = []
        if batch:
            count += self._delete_batch(batch, dry_run)
        return count

    def _delete_batch(self, names: list[str], dry_run: bool) -> int:
        if dry_run:
            return len(names)
        try:
            reply = self._data.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": n} for n in names], "Quiet": True})
        except Exception as e:
            raise self._translate(e, "gc delete", None)[0] from e
        failed = reply.get("Errors", [])
        for error in failed[:5]:
            log.warning("gc could not delete %s: %s", error.get("Key"), error.get("Code"))
        for name in names:
            key = self._key_of(name)
            if key is not None:
                self._forget(key)
        self._count("deletes", len(names) - len(failed))
        return len(names) - len(failed)

    def close(self) -> None:
        for client in (getattr(self, "_data", None), getattr(self, "_probe", None)):
            if client is not None:
                client.close()

    def __repr__(self) -> str:
        return (f"S3Backend(name={self.name!r}, bucket={self.bucket!r}, "
                f"prefix={self._ns_prefix!r}, endpoint={self._where()!r}, "
                f"credentials={self._credential_source!r})")


# -- gc --------------------------------------------------------------------------------
