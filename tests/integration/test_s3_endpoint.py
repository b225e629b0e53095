"""The local S3 endpoint admits only its own key pair.

moto took any credentials: as user `nobody`, with made-up keys, one could list the
bucket, read a KV block and replace it with a forged one that the node served. The
attempts here are made for real: by another user (`nobody`, through the system's
own Python, stdlib only: nothing of ours is readable to it), over HTTP, each
request correctly signed (AWS Signature V4) with the keys that user has. The same
script run with the endpoint's own keys is served: the refusals are the keys'.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
from pathlib import Path
from typing import Any

import boto3
import pytest

from tierkv.node.config import config_from_dict
from tierkv.node.s3auth import KeyPair
from tierkv.node.s3server import S3Server, new_keys
from tierkv.node.supervisor import EMBEDDED, Node

BUCKET = "tierkv-f7"
OBJECT = "tierkv/ns/block-1"
BLOCK = b"KV block bytes " * 1000

# Run by another user with the system's Python: signs each request with the keys it
# is given, reports the HTTP status of each attempt as JSON.
INTRUDER = r'''
import datetime, hashlib, hmac, http.client, json, sys

port, key_id, secret, bucket, obj = sys.argv[1:6]
host = f"127.0.0.1:{port}"

def request(method, path, query="", body=b"", sign=True):
    headers = {}
    if sign:
        amz = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        payload = hashlib.sha256(body).hexdigest()
        headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz}
        names = sorted(headers)
        canonical = "\n".join([method, path, "&".join(sorted(query.split("&"))) if query else "",
                               "".join(f"{n}:{headers[n]}\n" for n in names),
                               ";".join(names), payload])
        scope = f"{amz[:8]}/us-east-1/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        k = ("AWS4" + secret).encode()
        for part in (amz[:8], "us-east-1", "s3", "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={key_id}/{scope}, "
                                    f"SignedHeaders={';'.join(names)}, Signature={signature}")
    conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=10)
    conn.request(method, path + ("?" + query if query else ""), body=body or None,
                 headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data

results = {
    "list": request("GET", f"/{bucket}", "list-type=2")[0],
    "read": request("GET", f"/{bucket}/{obj}")[0],
    "write": request("PUT", f"/{bucket}/{obj}", body=b"forged block")[0],
    "list_unsigned": request("GET", f"/{bucket}", "list-type=2", sign=False)[0],
    "list_buckets": request("GET", "/")[0],
    "moto_state": request("GET", "/moto-api/data.json", sign=False)[0],
    "moto_reset": request("POST", "/moto-api/reset", sign=False)[0],
}
print(json.dumps(results))
'''


def intruder_can_run() -> tuple[str, str] | None:
    """(user, python) to attack as, or None when this machine cannot switch users."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None:
        return None
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return None
    return "nobody", python


def attempt(port: int, keys: KeyPair, user: str | None) -> dict[str, int]:
    """Every attempt of INTRUDER, as `user` (None: this user) with `keys`."""
    runner = intruder_can_run()
    assert runner is not None
    _, python = runner
    out = subprocess.run(
        [python, "-c", INTRUDER, str(port), keys.access_key_id, keys.secret_access_key,
         BUCKET, OBJECT],
        user=user, group="nogroup" if user else None, extra_groups=[] if user else None,
        env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


needs_another_user = pytest.mark.skipif(
    intruder_can_run() is None,
    reason="needs root (to run an attempt as `nobody`) and /usr/bin/python3")


def boto(server: S3Server) -> Any:
    return boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                        **server.boto_keys)


@needs_another_user
def test_another_user_cannot_list_read_or_replace_a_block():
    with S3Server(keys=new_keys()) as server:
        s3 = boto(server)
        s3.create_bucket(Bucket=BUCKET)
        s3.put_object(Bucket=BUCKET, Key=OBJECT, Body=BLOCK)
        guessed = KeyPair(server.keys.access_key_id, "a-guess-at-the-secret-key")
        for keys in (KeyPair("AKIDMADEUP", "made-up-secret-access-key"), guessed):
            results = attempt(server.port, keys, "nobody")
            assert results == dict.fromkeys(results, 403), results
        # The node's block is the node's, and nothing else appeared or went.
        assert s3.get_object(Bucket=BUCKET, Key=OBJECT)["Body"].read() == BLOCK
        assert [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]] == [OBJECT]
        # The very same requests with the endpoint's own keys are served.
        served = attempt(server.port, server.keys, None)
        assert (served["list"], served["read"], served["write"]) == (200, 200, 200)
        assert served["list_unsigned"] == served["moto_state"] == served["moto_reset"] == 403


def test_refusals_are_s3_errors_that_sdks_understand():
    """boto3 with other keys gets the codes it knows (a tier says "the credentials
    were refused"), and a refused upload leaves the connection usable."""
    import botocore.exceptions
    from botocore.config import Config as BotoConfig

    with S3Server(keys=new_keys()) as server:
        boto(server).create_bucket(Bucket=BUCKET)
        for keys, code in ((KeyPair("AKIDMADEUP", "made-up-secret-access-key"),
                            "InvalidAccessKeyId"),
                           (KeyPair(server.keys.access_key_id, "x" * 40),
                            "SignatureDoesNotMatch")):
            other = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                                 aws_access_key_id=keys.access_key_id,
                                 aws_secret_access_key=keys.secret_access_key,
                                 config=BotoConfig(retries={"max_attempts": 1}))
            for call, kwargs in ((other.put_object, {"Key": OBJECT, "Body": BLOCK}),
                                 (other.list_objects_v2, {})):
                with pytest.raises(botocore.exceptions.ClientError) as e:
                    call(Bucket=BUCKET, **kwargs)
                assert e.value.response["Error"]["Code"] == code
                assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
        assert "Contents" not in boto(server).list_objects_v2(Bucket=BUCKET)


def test_the_key_pair_never_reaches_the_endpoints_command_line_or_environment():
    keys = new_keys()
    with S3Server(keys=keys) as server:
        proc = Path(f"/proc/{server.pid}")
        exposed = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
        assert keys.secret_access_key.encode() not in exposed
        assert keys.access_key_id.encode() not in exposed


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 16"):
        KeyPair("key", "local")
    assert "s" * 20 not in repr(KeyPair("key", "s" * 20))


@needs_another_user
def test_an_embedded_endpoint_admits_its_node_only(instance, tmp_path):
    """`endpoint_url = "embedded"`: the node makes a key pair of its own, hands it to
    the endpoint over a pipe and to its S3 tier processes in their environment
    (this user's only), and nobody else gets in."""
    config = config_from_dict({
        "instance": instance, "run_dir": str(tmp_path / "run"),
        "cpu": {"num_blocks": 16, "page_size": 4096}, "worker": {"enabled": False},
        "supervisor": {"ready_timeout_s": 60.0},
        "tiers": [{"type": "s3", "bucket": BUCKET, "endpoint_url": EMBEDDED}],
    })
    with Node(config) as node:
        # The S3 tier process is ready: it reached its bucket with the node's keys.
        assert node.children["tier:s3:0"].ready
        keys = node.s3.keys
        results = attempt(node.s3.port, KeyPair("AKIDMADEUP", "made-up-secret-access-key"),
                          "nobody")
        assert results == dict.fromkeys(results, 403), results
        served = boto(node.s3).list_objects_v2(Bucket=BUCKET)
        assert served["ResponseMetadata"]["HTTPStatusCode"] == 200
        written = node.config_path.read_text()
        assert keys.secret_access_key not in written and keys.access_key_id not in written
