"""Who may talk to the node and what it leaves readable: owner-only files, loopback
or CurveZMQ, and unkeyed clients refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.cluster import keys, leftovers
from tierkv.client import BrokerUnavailable, Client
from tierkv.core.shm import region_name
from tierkv.wire.sockets import CurveClientKeys, create_keys, ipc_path

REPO = Path(__file__).resolve().parents[2]


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_region_run_dir_and_sockets_are_owner_only(make_cluster):
    cluster = make_cluster()
    config = cluster.config
    assert mode(f"/dev/shm{region_name(config.instance)}") == 0o600
    assert mode(config.run_path) == 0o700
    for link in ("client", "worker", "tier"):
        path = ipc_path(config.address(link))
        assert path is not None and mode(path) == 0o600
    for kv in cluster.kv:
        assert mode(f"/dev/shm{kv.segment}") == 0o600


def test_tcp_beyond_loopback_without_keys_is_refused_before_anything_starts(instance, tmp_path):
    """The config check once accepted it; `tierkv up` started the supervisor,
    the broker created its shared memory and only then exited, naming a key that
    does not exist (broker.curve_server_secret_file). Now every way in refuses it
    first, naming the real keys, and nothing is made."""
    run = tmp_path / "run"
    path = tmp_path / "node.toml"
    path.write_text(f'instance = "{instance}"\nrun_dir = "{run}"\n'
                    f'[broker]\nclient_address = "tcp://0.0.0.0:0"\n')
    for argv in (["-m", "tierkv.cli", "config", "-c"], ["-m", "tierkv.cli", "up", "-c"],
                 ["-m", "tierkv.cli", "up", "--detach", "-c"], ["-m", "broker", "-c"]):
        out = subprocess.run([sys.executable, *argv, str(path)], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2, (argv, out.stderr)
        for said in ("broker.client_address", "reachable beyond loopback",
                     "broker.curve_secret_file", "broker.curve_authorized_dir"):
            assert said in out.stderr, (argv, out.stderr)
        assert "curve_server_secret_file" not in out.stderr
    assert not run.exists()
    assert leftovers(run, instance) == []


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_curve_lets_keyed_peers_in_and_keeps_unkeyed_clients_out(instance, tmp_path,
                                                                  make_cluster):
    keydir, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    _, broker_secret = create_keys(str(keydir), "broker")
    node_public, node_secret = create_keys(str(keydir), "node")
    os.link(node_public, allowed / "node.key")
    _, stranger_secret = create_keys(str(keydir), "stranger")
    ports = [free_port() for _ in range(3)]
    # Bound beyond loopback (all interfaces); the test itself connects to 127.0.0.1.
    cluster = make_cluster(
        broker={"client_address": f"tcp://0.0.0.0:{ports[0]}",
                "worker_address": f"tcp://0.0.0.0:{ports[1]}",
                "tier_address": f"tcp://0.0.0.0:{ports[2]}",
                "curve_secret_file": broker_secret, "curve_authorized_dir": str(allowed)},
        client={"curve_secret_file": node_secret,
                "curve_server_public_file": str(keydir / "broker.key")},
    )
    loopback = f"tcp://127.0.0.1:{ports[0]}"
    # Keyed: the whole node (workers and tiers included) works over curve.
    c = Client(loopback, timeout=10, curve=cluster.config.client.curve_keys())
    c.use_kv(cluster.registration_tokens)
    ks = keys(1, 2)
    cluster.fill(ks, [0, 1])
    store = c.store(ks, [0, 1])
    assert c.wait([store.job_id])[store.job_id].success
    assert c.lookup(ks).hits == 2
    stats = c.stats()
    c.close()
    # No secret key reaches a log line or a reply.
    secret_z85 = [line.split('"')[1] for line in Path(node_secret).read_text().splitlines()
                  + Path(broker_secret).read_text().splitlines() if "secret-key" in line]
    assert len(secret_z85) == 2
    written = "\n".join("\n".join(ch.log_lines) for ch in cluster.node.children.values())
    written += repr(stats) + (cluster.node.config_path.read_text()
                              if cluster.node.config_path.exists() else "")
    assert not any(s in written for s in secret_z85)
    # Unkeyed, or keyed but not allowed in: no answer, only a timeout.
    for curve in (None, CurveClientKeys(stranger_secret, str(keydir / "broker.key"))):
        with Client(loopback, timeout=1.5, curve=curve) as outsider:
            with pytest.raises(BrokerUnavailable):
                outsider.lookup(ks)
