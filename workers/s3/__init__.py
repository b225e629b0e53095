"""The S3 tier (`type = "s3"`): `backend.S3Backend`, one verified object per block in
any S3-compatible store, behind a circuit breaker (`breaker`), with zero-copy bodies
(`body`); `options` declares its config keys; `gc` is the `tierkv gc` command.

`S3Backend` is imported on first use: checking a config's s3 entry reads `options`
only and must not import boto3."""

from __future__ import annotations

from typing import Any

__all__ = ["S3Backend"]


def __getattr__(name: str) -> Any:
    if name == "S3Backend":
        from workers.s3.backend import S3Backend

        return S3Backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
