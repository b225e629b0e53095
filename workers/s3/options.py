"""The options of an S3 tier entry (`S3Backend` takes exactly these), as data.

Kept apart from `backend`, which imports boto3: the config loader checks an s3
entry with this module alone, before any process starts and without connecting
anywhere (whether the bucket exists is the tier process's to find out).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from tierkv.tiers.options import REQUIRED, Option, TierOptions, at_least, positive

# S3's bucket naming rules (the subset every S3-compatible store accepts).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def key_path_problem(path: str) -> str | None:
    """Some S3-compatible stores (file-backed MinIO, proxies) resolve `.` and `..` in
    object names, so a prefix or namespace made of them could reach another tenant's
    objects; control characters break listings. Both are refused."""
    if not path:
        return None
    bad = [part for part in path.split("/") if part in ("", ".", "..")]
    if bad or any(ord(ch) < 32 or ord(ch) == 127 for ch in path):
        return ("must be '/'-separated names without empty, '.' or '..' parts or control "
                "characters")
    return None


def _bucket(name: str) -> str | None:
    if _BUCKET.fullmatch(name) and ".." not in name:
        return None
    return (f"{name!r} is not a valid bucket name (3 to 63 lowercase letters, digits, "
            f"dots and hyphens, starting and ending with a letter or digit)")


def _prefix(prefix: str) -> str | None:
    why = key_path_problem(prefix.strip("/"))
    return f"{prefix!r} {why}" if why else None


def _env_set(var: str) -> str | None:
    if var and not os.environ.get(var):
        return f"names the environment variable {var}, which is not set"
    return None


def _credentials_pair(entry: Mapping[str, Any]) -> tuple[str, str] | None:
    if bool(entry.get("access_key_id_env")) != bool(entry.get("secret_access_key_env")):
        return ("access_key_id_env", "and secret_access_key_env go together (give both, or "
                                     "neither to use the AWS chain)")
    return None


_INLINE = ("credentials are never read from the config file (it is copied to the run "
           "directory and lands in backups): put them in environment variables and name "
           "those with access_key_id_env / secret_access_key_env / session_token_env, or use "
           "the AWS chain")

OPTIONS = TierOptions(
    "s3",
    "one verified object per block in any S3-compatible store (AWS, MinIO, Ceph RGW, moto)",
    (
        Option("bucket", str, REQUIRED, "the bucket; see create_bucket", check=_bucket),
        Option("prefix", str, "tierkv", "objects are named <prefix>/<namespace>/<key hex>",
               check=_prefix),
        Option("endpoint_url", str, "",
               "empty: AWS for `region`; any S3 endpoint URL; \"embedded\": a local moto "
               "endpoint that the node starts and stops (with create_bucket)"),
        Option("region", str, "us-east-1", "the bucket's region"),
        Option("addressing_style", str, "auto", "bucket in the path or the host name",
               choices=("auto", "path", "virtual")),
        Option("max_concurrency", int, 16, "requests in flight per tier process",
               check=at_least(1)),
        Option("connect_timeout_s", float, 2.0, "to open a connection", check=positive),
        Option("read_timeout_s", float, 10.0, "to read a reply", check=positive),
        Option("exists_timeout_s", float, 2.0, "of one existence check (the broker waits on "
               "it)", check=positive),
        Option("max_attempts", int, 4, "tries of one request (botocore's retries, with "
               "backoff)", check=at_least(1)),
        Option("retry_mode", str, "standard", "botocore's retry mode",
               choices=("standard", "adaptive")),
        Option("access_key_id_env", str, "", "the environment variable that holds the access "
               "key id (empty: the AWS chain)", local=_env_set),
        Option("secret_access_key_env", str, "", "the environment variable that holds the "
               "secret key", local=_env_set),
        Option("session_token_env", str, "", "the environment variable that holds a session "
               "token", local=_env_set),
        Option("profile", str, "", "an AWS profile of ~/.aws (the AWS chain)"),
        Option("create_bucket", bool, False, "create the bucket when it does not exist (a "
               "local endpoint starts empty)"),
        Option("budget_bytes", int, 0, "LRU budget of each tier process; 0: unbounded",
               check=at_least(0)),
        Option("inventory_limit", int, 100_000, "objects listed at start (0: none; the rest "
               "are found by existence checks)", check=at_least(0)),
        Option("breaker_failures", int, 5, "final failures in a row that open the circuit "
               "breaker (jobs then fail at once)", check=at_least(1)),
        Option("breaker_cooldown_s", float, 5.0, "how long the breaker stays open before one "
               "trial request", check=positive),
    ),
    refused=dict.fromkeys(("aws_access_key_id", "aws_secret_access_key", "aws_session_token"),
                          _INLINE),
    rules=(_credentials_pair,),
)
