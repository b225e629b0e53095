"""The embedded S3 endpoint: what a node runs for a tier with `endpoint_url =
"embedded"` (the demo's), a moto endpoint of its own on loopback.

It is one of the node's supervised processes (`ENDPOINT`, beside the broker, the
workers and the tiers), with two differences the supervisor minds:
- it is restarted on the port it had, with the key pair it had: the tier
  processes' config names its URL and their environment holds the keys, and both
  stay valid;
- it keeps its objects in memory, so a restarted endpoint holds nothing. The tier
  processes that use it (`users`) are restarted after it: each says hello again
  with the (empty) inventory of the new endpoint, and the broker, which dropped
  the tier's blocks when its processes died, counts nothing that is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierkv.node.config import Config, tier_name
from tierkv.node.lifecycle import Child
from tierkv.node.s3server import S3Server, new_keys

EMBEDDED = "embedded"  # endpoint_url of an S3 tier served by a local moto endpoint
EMBEDDED_KEY_ENV = "TIERKV_EMBEDDED_S3_KEY"  # its key pair, in the tier processes' env
EMBEDDED_SECRET_ENV = "TIERKV_EMBEDDED_S3_SECRET"
ENDPOINT = "s3-endpoint"  # its name among the node's processes


def wants_endpoint(config: Config) -> bool:
    return any(t.get("endpoint_url") == EMBEDDED for t in config.tiers)


def embedded_entry(entry: dict[str, Any], endpoint_url: str) -> dict[str, Any]:
    """An embedded S3 tier's entry as its processes read it: the endpoint, and its
    key pair by the variables that hold it (whatever credentials the entry named)."""
    entry = {k: v for k, v in entry.items() if k not in ("session_token_env", "profile")}
    return {**entry, "endpoint_url": endpoint_url, "create_bucket": True,
            "access_key_id_env": EMBEDDED_KEY_ENV, "secret_access_key_env": EMBEDDED_SECRET_ENV}


def users(config: Config) -> set[str]:
    """The processes (`tier:<name>:<i>`) that store in the embedded endpoint."""
    return {f"tier:{tier_name(entry)}:{i}" for entry in config.tiers
            if entry.get("endpoint_url") == EMBEDDED
            for i in range(int(entry.get("processes", 1)))}


def start_endpoint(config: Config, sink: Callable[[str], None] | None,
                   previous: S3Server | None = None) -> S3Server:
    """A started endpoint: a new one with a new random key pair, or, after
    `previous` died, its successor on the same port with the same keys (both reach
    the endpoint over its secret pipe, never its command line or environment).
    Blocks until it answers HTTP, `supervisor.ready_timeout_s` at most; raises
    S3ServerError (the port taken meanwhile, say) with `previous` left as it was."""
    timeout = config.supervisor.ready_timeout_s
    if previous is None:
        return S3Server(ready_timeout_s=timeout, name=ENDPOINT, sink=sink, keys=new_keys()).start()
    previous.stop()  # reaped already by whoever saw it die: this closes its pipes
    assert previous.port is not None, "a successor of an endpoint that never started"
    return S3Server(host=previous.host, port=previous.port, ready_timeout_s=timeout,
                    name=ENDPOINT, sink=sink, keys=previous.keys).start()


def endpoint_env(server: S3Server) -> dict[str, str]:
    """The variables that hand the endpoint's key pair to its tier processes."""
    return {EMBEDDED_KEY_ENV: server.keys.access_key_id,
            EMBEDDED_SECRET_ENV: server.keys.secret_access_key}


def endpoint_child(server: S3Server) -> Child:
    assert server.child is not None, "the endpoint is not started"
    return server.child
