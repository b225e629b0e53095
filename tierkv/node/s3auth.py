"""The local S3 endpoint admits only requests signed with its one key pair.

moto, the endpoint's engine, takes any credentials: any process on the host that
reaches its loopback port could list the bucket, read a KV block, or replace one
with a forged block that the node would serve (its checksum is the forger's to
compute). So the endpoint wraps moto's WSGI application in `SignedOnly`, which
checks every request's AWS Signature V4 against the key pair the endpoint was
given (by its parent, over the secret pipe) before moto sees it, with the same
canonical request the client signed (botocore's, S3 flavour: the path as sent).
Everything else is refused with an S3 error (403) that SDKs understand: no
signature, another access key, a wrong signature, a stale date, a presigned URL,
another service, and moto's own control API (`/moto-api/`: reset, state dumps).

What it does not check: the payload hash a request declares (the signature covers
the declaration). Loopback traffic cannot be read or altered by another user, so
a valid signature can only come from a holder of the secret.

Runs in the endpoint process only (moto and botocore are imported there).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

ALGORITHM = "AWS4-HMAC-SHA256"
MAX_SKEW_S = 900  # AWS's own limit (RequestTimeTooSkewed)
DRAIN_LIMIT = 64 << 20  # a refused request's body read (and dropped) at most: see _refuse
MIN_SECRET_CHARS = 16

StartResponse = Callable[..., Any]


@dataclass(frozen=True)
class KeyPair:
    access_key_id: str
    secret_access_key: str

    def __post_init__(self) -> None:
        if not self.access_key_id or ":" in self.access_key_id:
            raise ValueError("the access key id must be non-empty, without ':'")
        if len(self.secret_access_key) < MIN_SECRET_CHARS:
            raise ValueError(f"the secret access key must have at least {MIN_SECRET_CHARS} "
                             f"characters: a short one can be guessed by anyone on this host")

    def __repr__(self) -> str:  # never the secret, in a log line or a traceback
        return f"KeyPair({self.access_key_id!r}, <secret>)"


class Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SignedOnly:
    """WSGI middleware: `app` sees only requests signed with `keys`."""

    def __init__(self, app: Callable[..., Iterable[bytes]], keys: KeyPair,
                 clock: Callable[[], float] = time.time) -> None:
        self.app = app
        self.keys = keys
        self.clock = clock

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        try:
            self.check(environ)
        except Refused as e:
            return _refuse(environ, start_response, e)
        return self.app(environ, start_response)

    def check(self, environ: dict[str, Any]) -> None:
        """Raise Refused unless the request is signed with our key pair."""
        target = environ.get("RAW_URI") or environ.get("REQUEST_URI") or ""
        path = target.split("?", 1)[0]
        if path.startswith("/moto-api"):
            raise Refused("AccessDenied", "this endpoint serves S3 only")
        auth = environ.get("HTTP_AUTHORIZATION", "")
        if not auth:
            query = environ.get("QUERY_STRING", "")
            if "X-Amz-Signature=" in query or "Signature=" in query:
                raise Refused("AccessDenied", "presigned URLs are not accepted here")
            raise Refused("AccessDenied", "anonymous access is not allowed: sign the request")
        fields = _auth_fields(auth)
        scope = fields["Credential"].split("/")
        if len(scope) != 5 or scope[4] != "aws4_request":
            raise Refused("AuthorizationHeaderMalformed", "malformed credential scope")
        key_id, day, region, service, _ = scope
        if not hmac.compare_digest(key_id.encode(), self.keys.access_key_id.encode()):
            raise Refused("InvalidAccessKeyId",
                          "the access key id you provided does not exist in our records")
        if service != "s3":
            raise Refused("AccessDenied", "this endpoint serves S3 only")
        amz_date = environ.get("HTTP_X_AMZ_DATE", "")
        self._check_date(amz_date, day)
        signed = fields["SignedHeaders"].split(";")
        if "host" not in signed:
            raise Refused("AccessDenied", "the host header must be signed")
        expected = self.signature(environ, target, signed, amz_date, region)
        if not hmac.compare_digest(expected.encode(), fields["Signature"].encode()):
            raise Refused("SignatureDoesNotMatch", "the request signature we calculated "
                          "does not match the signature you provided")

    def _check_date(self, amz_date: str, day: str) -> None:
        try:
            when = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        except ValueError:
            raise Refused("AccessDenied", "missing or malformed x-amz-date") from None
        if amz_date[:8] != day:
            raise Refused("SignatureDoesNotMatch", "the credential scope's date is not "
                          "the request's")
        if abs(when.timestamp() - self.clock()) > MAX_SKEW_S:
            raise Refused("RequestTimeTooSkewed", "the difference between the request time "
                          "and the current time is too large")

    def signature(self, environ: dict[str, Any], target: str, signed: list[str],
                  amz_date: str, region: str) -> str:
        """The signature our secret gives this request, as botocore computes it on
        the client side."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        headers = {}
        for name in signed:
            value = _header(environ, name)
            if value is None:
                raise Refused("AccessDenied", f"signed header {name!r} is missing")
            headers[name] = value
        request = AWSRequest(method=environ.get("REQUEST_METHOD", "GET"),
                             url=f"http://{headers['host']}{target}", headers=headers)
        request.context["timestamp"] = amz_date
        auth = S3SigV4Auth(Credentials(self.keys.access_key_id, self.keys.secret_access_key),
                           "s3", region)
        canonical = auth.canonical_request(request)
        return str(auth.signature(auth.string_to_sign(request, canonical), request))


def _auth_fields(auth: str) -> dict[str, str]:
    algorithm, _, rest = auth.partition(" ")
    if algorithm != ALGORITHM:
        raise Refused("AccessDenied", f"only {ALGORITHM} signatures are accepted")
    fields = {}
    for part in rest.split(","):
        name, _, value = part.strip().partition("=")
        fields[name] = value
    if not all(fields.get(k) for k in ("Credential", "SignedHeaders", "Signature")):
        raise Refused("AuthorizationHeaderMalformed", "the authorization header is malformed")
    return fields


def _header(environ: dict[str, Any], name: str) -> str | None:
    if name in ("content-type", "content-length"):
        value = environ.get(name.upper().replace("-", "_"))
    else:
        value = environ.get("HTTP_" + name.upper().replace("-", "_"))
    return None if value is None else str(value)


def _refuse(environ: dict[str, Any], start_response: StartResponse,
            refused: Refused) -> Iterable[bytes]:
    # Read the body a client already sent (a PUT that got its 100 Continue): left
    # unread, it would be taken for the next request on the kept-alive connection.
    body = environ.get("wsgi.input")
    left = min(int(environ.get("CONTENT_LENGTH") or 0), DRAIN_LIMIT)
    while body is not None and left > 0:
        chunk = body.read(min(left, 1 << 20))
        if not chunk:
            break
        left -= len(chunk)
    text = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{refused.code}</Code>'
            f"<Message>{refused.message}</Message><RequestId>0</RequestId></Error>")
    data = b"" if environ.get("REQUEST_METHOD") == "HEAD" else text.encode()
    start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                     ("Content-Length", str(len(text.encode())))])
    return [data]
