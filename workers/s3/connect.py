"""Connecting the S3 tier: options checked, credentials found (never from the config
file), clients built, and every botocore failure translated at the edge into one of
tierkv's error codes with a message that carries no secret."""

from __future__ import annotations

import http.client
import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import boto3
import botocore.exceptions as bexc
import botocore.loaders
import botocore.session
from botocore.config import Config as BotoConfig
from urllib3.exceptions import HTTPError as URLLib3Error

from tierkv.core.errors import ErrorCode, TierError
from tierkv.node.logs import redact
from tierkv.tiers.registry import TierConfigError
from workers.s3.body import StreamBroken
from workers.s3.options import key_path_problem

NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
AUTH_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "ExpiredToken", "InvalidToken", "403"})
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                            "ServiceUnavailable", "InternalError", "503", "500"})
TRANSPORT_ERRORS = (bexc.ConnectionError, bexc.HTTPClientError, OSError,
                    http.client.HTTPException, URLLib3Error)
# One loader for every session of this process: it caches the parsed S3 service
# model, which makes a client 20x cheaper to build after the first.
_LOADER = botocore.loaders.create_loader()


def safe_url(url: str) -> str:
    """An endpoint as it may be shown: without user info or query."""
    if not url:
        return ""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def env_secret(var: str, option: str) -> str:
    value = os.environ.get(var)
    if not value:
        raise TierConfigError(f"s3 tier: {option} names the environment variable {var}, "
                              f"which is not set")
    return value


def check_key_path(label: str, path: str) -> None:
    """A prefix or namespace that could reach another tenant's objects is refused
    (`workers.s3.options.key_path_problem` says why)."""
    why = key_path_problem(path)
    if why is not None:
        raise TierConfigError(f"{label} {path!r} {why}")


def check_options(name: str, bucket: str, addressing_style: str, retry_mode: str,
                  max_concurrency: int, max_attempts: int, budget_bytes: int) -> None:
    label = f"s3 tier {name!r}"
    if not bucket:
        raise TierConfigError(f"{label}: the option bucket is required")
    if addressing_style not in ("auto", "path", "virtual"):
        raise TierConfigError(f"{label}: addressing_style must be auto, path or virtual")
    if retry_mode not in ("standard", "adaptive"):
        raise TierConfigError(f"{label}: retry_mode must be standard or adaptive")
    if max_concurrency < 1 or max_attempts < 1 or budget_bytes < 0:
        raise TierConfigError(
            f"{label}: max_concurrency and max_attempts must be >= 1, budget_bytes >= 0")


def open_session(
    name: str, where: str, region: str, key_env: str, secret_env: str, token_env: str,
    profile: str,
) -> tuple[boto3.session.Session, str, tuple[str, ...]]:
    """A private boto3 session; returns it, where its credentials come from (names
    only) and the values to redact from foreign messages."""
    core = botocore.session.Session()
    core.register_component("data_loader", _LOADER)
    if key_env or secret_env:
        if not (key_env and secret_env):
            raise TierConfigError(f"s3 tier {name!r}: give both access_key_id_env "
                                  f"and secret_access_key_env, or neither")
        key = env_secret(key_env, "access_key_id_env")
        secret = env_secret(secret_env, "secret_access_key_env")
        token = env_secret(token_env, "session_token_env") if token_env else None
        session = boto3.session.Session(aws_access_key_id=key, aws_secret_access_key=secret,
                                        aws_session_token=token, region_name=region,
                                        botocore_session=core)
        source = f"environment variables {key_env}, {secret_env}"
        return session, source + (f", {token_env}" if token_env else ""), tuple(
            s for s in (key, secret, token) if s)
    session = boto3.session.Session(profile_name=profile or None, region_name=region,
                                    botocore_session=core)
    creds = session.get_credentials()
    if creds is None:
        raise TierConfigError(
            f"s3 tier {name!r}: no AWS credentials found for {where} (set "
            f"access_key_id_env / secret_access_key_env, or provide them through the AWS "
            f"chain)")
    frozen = creds.get_frozen_credentials()
    secrets = tuple(s for s in (frozen.access_key, frozen.secret_key, frozen.token) if s)
    return session, f"the AWS chain ({creds.method})", secrets


def make_clients(session: boto3.session.Session, endpoint_url: str, region: str, style: str,
                 pool: int, connect_s: float, read_s: float, exists_s: float,
                 max_attempts: int, retry_mode: str) -> tuple[Any, Any]:
    """The data client (shared by all I/O threads, a pool as large as the
    concurrency) and a probe client for `exists` and the start-up check: short
    timeouts and no retries, so a lookup is never held up by a sick endpoint."""
    s3 = {"addressing_style": style, "payload_signing_enabled": False}
    common = dict(s3=s3, max_pool_connections=pool,
                  request_checksum_calculation="when_required",
                  response_checksum_validation="when_required")
    data = BotoConfig(connect_timeout=connect_s, read_timeout=read_s,
                      retries={"max_attempts": max_attempts, "mode": retry_mode}, **common)
    probe = BotoConfig(connect_timeout=min(connect_s, exists_s), read_timeout=exists_s,
                       retries={"max_attempts": 1, "mode": "standard"}, **common)
    kwargs = {"endpoint_url": endpoint_url or None, "region_name": region}
    return session.client("s3", config=data, **kwargs), session.client(
        "s3", config=probe, **kwargs)


def translate(e: Exception, what: str, where: str, secrets: tuple[str, ...]
              ) -> tuple[TierError, bool]:
    """(the error to raise, whether it says the endpoint is unhealthy). `what` names
    the request, `where` the endpoint; `secrets` are masked in foreign messages."""
    if isinstance(e, TierError):
        return e, isinstance(e, StreamBroken)
    if isinstance(e, bexc.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        detail = redact(str(err.get("Message", ""))[:200], *secrets)
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
        return TierError(ErrorCode.UNAVAILABLE, f"{what}: {where} unreachable "
                                                f"({type(e).__name__})"), True
    if isinstance(e, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
        return TierError(ErrorCode.FATAL, f"{what}: no credentials"), True
    message = redact(f"{what}: {type(e).__name__}: {e}"[:300], *secrets)
    return TierError(ErrorCode.FATAL, message), False
