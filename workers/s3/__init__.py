"""The S3 tier (`type = "s3"`): `backend.S3Backend`, one verified object per block in
any S3-compatible store, behind a circuit breaker (`breaker`), with zero-copy bodies
(`body`); `gc` is the `tierkv gc` command."""

from workers.s3.backend import S3Backend

__all__ = ["S3Backend"]
