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
`tierkv.blockformat` (header + payload), verified on every load; a block that
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

import argparse
import http.client
import io
import logging
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit, urlunsplit

import boto3
import botocore.exceptions as bexc
import botocore.loaders
import botocore.session
from botocore.config import Config as BotoConfig
from urllib3.exceptions import HTTPError as URLLib3Error

from tierkv.blockformat import HEADER_SIZE, CorruptBlock, pack_header, unpack_header, verify
from tierkv.errors import ErrorCode, TierError
from tierkv.keys import OffloadKey
from tierkv.logs import redact
from tierkv.tiers.backend import TierBackend
from tierkv.tiers.registry import FRAMEWORK_KEYS, TierConfigError

log = logging.getLogger("tierkv.s3")
T = TypeVar("T")

NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
AUTH_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "ExpiredToken", "InvalidToken", "403"})
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                            "ServiceUnavailable", "InternalError", "503", "500"})
TRANSPORT_ERRORS = (bexc.ConnectionError, bexc.HTTPClientError, OSError,
                    http.client.HTTPException, URLLib3Error)
DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes
# One loader for every session of this process: it caches the parsed S3 service
# model, which makes a client 20x cheaper to build after the first.
_LOADER = botocore.loaders.create_loader()


class CircuitBreaker:
    """CLOSED → (n final failures in a row) → OPEN → (cool-down) → HALF_OPEN, where
    one trial request decides between CLOSED and OPEN again. Thread-safe."""

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, failures: int, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("breaker_failures must be >= 1 and breaker_cooldown_s > 0")
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = self.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial = False
        self.opens = 0

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def retry_in(self) -> float:
        with self._lock:
            return max(0.0, self._opened_at + self.cooldown_s - self._clock())

    def allow(self) -> bool:
        """May a request go out now? In HALF_OPEN only the one trial may."""
        with self._lock:
            if self._state == self.OPEN and self._clock() >= self._opened_at + self.cooldown_s:
                self._state, self._trial = self.HALF_OPEN, False
            if self._state == self.CLOSED:
                return True
            if self._state == self.HALF_OPEN and not self._trial:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            if self._state != self.CLOSED:
                log.info("s3 endpoint answers again: circuit closed")
            self._state, self._failures, self._trial = self.CLOSED, 0, False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state == self.HALF_OPEN or (
                self._state == self.CLOSED and self._failures >= self.threshold
            ):
                self._state, self._opened_at, self._trial = self.OPEN, self._clock(), False
                self.opens += 1
                log.warning("s3 endpoint failed %d times in a row: circuit open for %.1fs",
                            self._failures, self.cooldown_s)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"breaker": self._state, "breaker_opens": self.opens,
                    "consecutive_failures": self._failures}


class BlockBody(io.RawIOBase):
    """[header][payload] as one seekable stream, without joining them: `read` hands
    out memoryview slices of the two parts (http.client sends them as they are),
    and botocore rewinds it with `seek` to retry."""

    def __init__(self, header: bytes, payload: memoryview) -> None:
        super().__init__()
        self._parts = [memoryview(header), payload]
        self._size = len(header) + len(payload)
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        return self._pos

    def read(self, size: int | None = -1) -> memoryview:
        if self.closed:
            raise ValueError("read of a closed block body")
        if size is None or size < 0:
            size = self._size - self._pos
        offset = self._pos
        for part in self._parts:
            if offset < len(part):
                chunk = part[offset : offset + size]
                self._pos += len(chunk)
                return chunk
            offset -= len(part)
        return memoryview(b"")

    def readinto(self, b: Any) -> int:
        chunk = self.read(len(b))
        b[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        """Release our views of the row, so the region can be unmapped later."""
        for part in self._parts:
            part.release()
        super().close()


def _flat(view: memoryview | bytes | bytearray) -> memoryview:
    mv = memoryview(view)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _reader(body: Any) -> tuple[Callable[[memoryview], int], Callable[[], None]]:
    """(readinto, release) for a GET body. Reads straight from the `http.client`
    response under urllib3 when nothing sits between it and the socket; otherwise
    botocore's `readinto` (which copies once inside urllib3)."""
    raw: Any = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if (raw is not None and isinstance(fp, http.client.HTTPResponse) and not fp.chunked
            and getattr(raw, "_fp_bytes_read", None) == 0
            and raw.headers.get("content-encoding", "identity") == "identity"):
        return fp.readinto, raw.release_conn
    return body.readinto, body.close


def _fill(readinto: Callable[[memoryview], int], view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = readinto(view[pos:])
        if not n:
            raise _StreamBroken(f"the response ended after {pos} of {len(view)} bytes")
        pos += n


class _StreamBroken(TierError):
    """The connection failed while a body streamed: the object may be fine."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.RETRYABLE, message)


def _safe_url(url: str) -> str:
    """An endpoint as it may be shown: without user info or query."""
    if not url:
        return ""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _env(var: str, option: str) -> str:
    value = os.environ.get(var)
    if not value:
        raise TierConfigError(f"s3 tier: {option} names the environment variable {var}, "
                              f"which is not set")
    return value


class S3Backend(TierBackend):
    type_name: ClassVar[str] = "s3"
    shared: ClassVar[bool] = True

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
        self._check_options(bucket, addressing_style, retry_mode, max_concurrency, max_attempts,
                            budget_bytes)
        _check_key_path(f"s3 tier {name!r}: prefix", prefix.strip("/"))
        _check_key_path(f"s3 tier {name!r}: namespace", namespace)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.endpoint = _safe_url(endpoint_url)
        self.region = region
        self.max_attempts = max_attempts
        self.budget_bytes = budget_bytes
        self.inventory_limit = inventory_limit
        self._ns_prefix = "/".join(p for p in (self.prefix, namespace) if p) + "/"
        self._breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        self._lru: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> object bytes
        self._used = 0
        self._evicted: list[OffloadKey] = []
        self._counters: dict[str, int] = dict.fromkeys(
            ("puts", "gets", "heads", "deletes", "bytes_put", "bytes_got", "retries",
             "errors", "errors_corrupt", "fast_fails", "evictions", "requests_in_flight"), 0)
        session, self._credential_source, self._secrets = self._session(
            access_key_id_env, secret_access_key_env, session_token_env, profile)
        self._data, self._probe = self._clients(
            session, endpoint_url, addressing_style, max_concurrency, connect_timeout_s,
            read_timeout_s, exists_timeout_s, retry_mode)
        try:
            self._check_bucket(create_bucket)
        except BaseException:
            self.close()
            raise
        log.info("s3 tier %s: bucket %s at %s, objects under %s, credentials from %s",
                 name, bucket, self._where(), self._ns_prefix, self._credential_source)

    # -- construction ------------------------------------------------------------------

    def _check_options(self, bucket: str, addressing_style: str, retry_mode: str,
                       max_concurrency: int, max_attempts: int, budget_bytes: int) -> None:
        label = f"s3 tier {self.name!r}"
        if not bucket:
            raise TierConfigError(f"{label}: the option bucket is required")
        if addressing_style not in ("auto", "path", "virtual"):
            raise TierConfigError(f"{label}: addressing_style must be auto, path or virtual")
        if retry_mode not in ("standard", "adaptive"):
            raise TierConfigError(f"{label}: retry_mode must be standard or adaptive")
        if max_concurrency < 1 or max_attempts < 1 or budget_bytes < 0:
            raise TierConfigError(
                f"{label}: max_concurrency and max_attempts must be >= 1, budget_bytes >= 0")

    def _session(self, key_env: str, secret_env: str, token_env: str,
                 profile: str) -> tuple[boto3.session.Session, str, tuple[str, ...]]:
        """A private boto3 session; returns it, where its credentials come from (names
        only) and the values to redact from foreign messages."""
        core = botocore.session.Session()
        core.register_component("data_loader", _LOADER)
        if key_env or secret_env:
            if not (key_env and secret_env):
                raise TierConfigError(f"s3 tier {self.name!r}: give both access_key_id_env "
                                      f"and secret_access_key_env, or neither")
            key, secret = _env(key_env, "access_key_id_env"), _env(secret_env,
                                                                     "secret_access_key_env")
            token = _env(token_env, "session_token_env") if token_env else None
            session = boto3.session.Session(aws_access_key_id=key, aws_secret_access_key=secret,
                                            aws_session_token=token, region_name=self.region,
                                            botocore_session=core)
            source = f"environment variables {key_env}, {secret_env}"
            return session, source + (f", {token_env}" if token_env else ""), tuple(
                s for s in (key, secret, token) if s)
        session = boto3.session.Session(profile_name=profile or None, region_name=self.region,
                                        botocore_session=core)
        creds = session.get_credentials()
        if creds is None:
            raise TierConfigError(
                f"s3 tier {self.name!r}: no AWS credentials found for bucket {self.bucket!r} "
                f"at {self._where()} (set access_key_id_env / secret_access_key_env, or "
                f"provide them through the AWS chain)")
        frozen = creds.get_frozen_credentials()
        secrets = tuple(s for s in (frozen.access_key, frozen.secret_key, frozen.token) if s)
        return session, f"the AWS chain ({creds.method})", secrets

    def _clients(self, session: boto3.session.Session, endpoint_url: str, style: str,
                 pool: int, connect_s: float, read_s: float, exists_s: float,
                 retry_mode: str) -> tuple[Any, Any]:
        """The data client (shared by all I/O threads, a pool as large as the
        concurrency) and a probe client for `exists` and the start-up check: short
        timeouts and no retries, so a lookup is never held up by a sick endpoint."""
        s3 = {"addressing_style": style, "payload_signing_enabled": False}
        common = dict(s3=s3, max_pool_connections=pool,
                      request_checksum_calculation="when_required",
                      response_checksum_validation="when_required")
        data = BotoConfig(connect_timeout=connect_s, read_timeout=read_s,
                          retries={"max_attempts": self.max_attempts, "mode": retry_mode},
                          **common)
        probe = BotoConfig(connect_timeout=min(connect_s, exists_s), read_timeout=exists_s,
                           retries={"max_attempts": 1, "mode": "standard"}, **common)
        kwargs = {"endpoint_url": endpoint_url or None, "region_name": self.region}
        return session.client("s3", config=data, **kwargs), session.client(
            "s3", config=probe, **kwargs)

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
        """(the error to raise, whether it says the endpoint is unhealthy)."""
        if isinstance(e, TierError):
            return e, isinstance(e, _StreamBroken)
        what = f"s3 {op} of {key.hex() if key else self.bucket} in bucket {self.bucket}"
        if isinstance(e, bexc.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            detail = redact(str(err.get("Message", ""))[:200], *self._secrets)
            if code == "NoSuchBucket":  # deleted under us: nothing here works any more
                return TierError(ErrorCode.UNAVAILABLE, f"{what}: the bucket is gone"), True
            if code in NOT_FOUND_CODES or status == 404:
                return TierError(ErrorCode.NOT_FOUND, f"{what}: no such object"), False
            if code in AUTH_CODES or status == 403:
                return TierError(ErrorCode.FATAL, f"{what}: access denied ({code})"), True
            if code in THROTTLE_CODES or status >= 500:
                return TierError(ErrorCode.RETRYABLE, f"{what}: {code} after retries"), True
            return TierError(ErrorCode.FATAL, f"{what}: {code} {detail}".rstrip()), False
        if isinstance(e, (bexc.ReadTimeoutError, bexc.ConnectTimeoutError, TimeoutError)):
            return TierError(ErrorCode.TIMEOUT, f"{what}: timed out after retries"), True
        if isinstance(e, TRANSPORT_ERRORS):
            message = f"{what}: {self._where()} unreachable ({type(e).__name__})"
            return TierError(ErrorCode.UNAVAILABLE, message), True
        if isinstance(e, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
            return TierError(ErrorCode.FATAL, f"{what}: no credentials"), True
        message = redact(f"{what}: {type(e).__name__}: {e}"[:300], *self._secrets)
        return TierError(ErrorCode.FATAL, message), False

    # -- the backend -------------------------------------------------------------------

    def store(self, key: OffloadKey, src: memoryview, pinned: Container[OffloadKey] = ()) -> None:
        payload = _flat(src)
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
                self._lru[key] = size
                self._lru.move_to_end(key)
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
                    self._used -= self._lru.pop(victim)
                    victims.append(victim)
                self._evicted.extend(victims)
                self._counters["evictions"] += len(victims)
            self._lru[key] = size
            self._used += size
            return True, victims

    def _forget(self, key: OffloadKey) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self._used -= size

    def load(self, key: OffloadKey, dst: memoryview) -> None:
        view = _flat(dst)
        last: TierError | None = None
        for _ in range(self.max_attempts):  # botocore retries requests, not broken bodies
            try:
                self._call("get", key, lambda: self._get_into(key, view))
                break
            except _StreamBroken as e:
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
        readinto, release = _reader(body)
        complete = False
        header = bytearray(HEADER_SIZE)
        try:
            size, want = response.get("ContentLength"), HEADER_SIZE + len(view)
            if size != want:
                raise CorruptBlock(f"object is {size} bytes, a block is {want}")
            try:
                _fill(readinto, memoryview(header))
                _fill(readinto, view)
            except TRANSPORT_ERRORS as e:
                raise _StreamBroken(f"reading the body failed ({type(e).__name__})") from e
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
                known = OrderedDict((k, size) for k, size, _ in listed if k not in self._lru)
                known.update(self._lru)  # what we stored ourselves is the newest
                self._lru = known
                self._used = sum(known.values())
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
        with self._lock:
            for key in keys:
                if key in self._lru:
                    self._lru.move_to_end(key)

    def take_evicted(self) -> list[OffloadKey]:
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

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


def _check_key_path(label: str, path: str) -> None:
    """Some S3-compatible stores (file-backed MinIO, proxies) resolve `.` and `..` in
    object names, so a prefix or namespace made of them could reach another tenant's
    objects; control characters break listings. Both are refused."""
    if not path:
        return
    bad = [part for part in path.split("/") if part in ("", ".", "..")]
    if bad or any(ord(ch) < 32 or ord(ch) == 127 for ch in path):
        raise TierConfigError(f"{label} {path!r} must be '/'-separated names without empty, "
                              f"'.' or '..' parts or control characters")


def gc(entry: dict[str, Any], namespace: str, older_than_s: float, dry_run: bool) -> int:
    """Remove `namespace`'s objects older than `older_than_s` from the bucket of an
    s3 tier entry (`tierkv gc`). Returns how many were (or would be) deleted."""
    if older_than_s < 0:
        raise ValueError("older_than_s must be >= 0")
    options = {k: v for k, v in entry.items() if k not in FRAMEWORK_KEYS}
    try:
        backend = S3Backend(**options, namespace=namespace, name=str(entry.get("name", "s3")))
    except TypeError as e:
        raise TierConfigError(f"s3 tier entry: {e}") from e
    try:
        return backend.collect_garbage(older_than_s, dry_run)
    finally:
        backend.close()


_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """'90', '90s', '15m', '12h', '7d' -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 3600, 90m, 12h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def main(argv: list[str] | None = None) -> int:
    """`python -m workers.s3 gc -c tierkv.toml --older-than 7d [--dry-run]`."""
    from tierkv.config import ConfigError, load_config, tier_name
    from tierkv.logs import setup_logging

    parser = argparse.ArgumentParser(prog="python -m workers.s3")
    sub = parser.add_subparsers(dest="command", required=True)
    gc_parser = sub.add_parser("gc", help="delete a namespace's blocks older than an age")
    gc_parser.add_argument("-c", "--config", required=True, help="tierkv.toml")
    gc_parser.add_argument("--name", help="the s3 tier's name (default: the first s3 tier)")
    gc_parser.add_argument("--namespace", help="default: the config's namespace")
    gc_parser.add_argument("--older-than", type=parse_age, required=True, metavar="AGE")
    gc_parser.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    args = parser.parse_args(argv)
    setup_logging("s3-gc", "warning")
    try:
        config = load_config(args.config)
        entries = [t for t in config.tiers if t.get("type") == "s3"
                   and (args.name is None or tier_name(t) == args.name)]
        if not entries:
            raise ConfigError(f"{config.source}: no s3 tier"
                              + (f" named {args.name!r}" if args.name else ""))
        namespace = args.namespace or config.namespace
        count = gc(entries[0], namespace, args.older_than, args.dry_run)
    except (ConfigError, TierError, ValueError) as e:
        print(f"tierkv gc: {e}", file=sys.stderr)
        return 1
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {count} objects of namespace {namespace!r} older than {args.older_than:g}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
