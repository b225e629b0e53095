"""The embedded S3 endpoint (`endpoint_url = "embedded"`, what `tierkv demo` runs) is
a supervised process like the others: listed in the status, restarted on the same
port when it dies, its death logged. It keeps its objects in memory, so its
restart loses them: the supervisor then restarts the tier processes that use it,
the broker drops what they had reported, and new stores reach S3 again.

A real supervisor (`tierkv up`), a real moto endpoint, a CPU worker and an S3 tier;
the test plays the engine and owns the KV cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.conftest import new_instance
from tests.integration.cluster import LAYOUT, key_bytes, keys, leftovers, make_config
from tests.integration.test_supervisor import REPO, alive, stop_supervisor, wait_status
from tests.tiers.fixtures_s3 import TEST_ENV, unique_bucket
from tierkv.client import Client
from tierkv.engine import KVLayout, allocate_kv_cache
from tierkv.node.config import Config, dump_config
from tierkv.node.supervisor import EMBEDDED, EMBEDDED_SECRET_ENV

ENDPOINT = "s3-endpoint"
TIER = "tier:s3:0"
GPU_BLOCKS = 32
LAYOUT_PAGE = KVLayout.blocks_outer(num_blocks=1, **LAYOUT).page_size


def start_supervisor(config: Config, path: Path) -> subprocess.Popen:
    """`tierkv up` with dummy AWS settings (nothing may leave loopback), its output
    in node.log only (a pipe nobody reads could fill)."""
    path.write_text(dump_config(config))
    return subprocess.Popen(
        [sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)], cwd=REPO,
        env={**os.environ, **TEST_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)


def children(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in status["children"]}


def up(status: dict[str, Any]) -> bool:
    return all(children(status).get(n, {}).get("alive") for n in
               ("broker", "worker0", TIER, ENDPOINT))


def block_view(kv: Any, gpu_block: int) -> np.ndarray:
    tensor = kv.tensors[0]
    return tensor[gpu_block].view(-1).view(dtype=tensor.dtype).numpy().view(np.uint8)


def fill(kv: Any, block_keys: list[bytes], gpu_blocks: list[int]) -> None:
    for key, block in zip(block_keys, gpu_blocks, strict=True):
        view = block_view(kv, block)
        view[:] = np.frombuffer(key_bytes(key, 0, view.size), dtype=np.uint8)


def holds(kv: Any, block_keys: list[bytes], gpu_blocks: list[int]) -> bool:
    return all(bytes(block_view(kv, b)) == key_bytes(k, 0, LAYOUT_PAGE)
               for k, b in zip(block_keys, gpu_blocks, strict=True))


def poll(c: Client, predicate: Any, timeout: float = 30.0) -> Any:
    """Step the client until `predicate()` is true; the deadline is the test's."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        c.step()
        time.sleep(0.02)
    return value


def s3_stats(c: Client) -> dict[str, Any]:
    return c.stats()["tiers"]["s3"]


def store(c: Client, kv: Any, block_keys: list[bytes], gpu_blocks: list[int]) -> None:
    """Store into the CPU tier (asking again while it has no room) and wait until the
    S3 tier has stored them too."""
    before = s3_stats(c)["stores"]
    fill(kv, block_keys, gpu_blocks)
    job = poll(c, lambda: (s := c.store(block_keys, gpu_blocks)) and not s.refused and s)
    assert c.wait([job.job_id], timeout=30)[job.job_id].success
    poll(c, lambda: s3_stats(c)["stores"] >= before + len(block_keys))


def tier_serves(c: Client, pid: int) -> bool:
    """The S3 tier process `pid` is ready at the broker and its circuit is closed."""
    stats = c.stats()
    ready = any(p["pid"] == pid and p["state"] == "ready" for p in stats["peers"])
    backend = stats["tiers"]["s3"]["backend"]
    return ready and [b.get("pid") for b in backend] == [pid] and backend[0]["breaker"] == "closed"


def load_from_s3(c: Client, kv: Any, block_keys: list[bytes], gpu_blocks: list[int],
                 req_id: str) -> None:
    """Lookup until the keys are CPU hits (promoted from S3), load them, check bytes."""
    poll(c, lambda: c.lookup(block_keys, req_id).hits == len(block_keys))
    for b in gpu_blocks:
        block_view(kv, b)[:] = 0xEE
    job = c.load(block_keys, gpu_blocks, req_id=req_id)
    assert c.wait([job.job_id], timeout=30)[job.job_id].success
    assert holds(kv, block_keys, gpu_blocks)
    c.finish(req_id)


def secret_of(pid: int) -> bytes:
    """The endpoint's secret key, from the S3 tier process's environment."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    prefix = EMBEDDED_SECRET_ENV.encode() + b"="
    return next(e[len(prefix):] for e in env if e.startswith(prefix))


def test_a_killed_embedded_endpoint_is_restarted_on_its_port_and_its_lost_blocks_dropped(
        tmp_path):
    instance = new_instance()
    tier = {"type": "s3", "name": "s3", "bucket": unique_bucket("emb"), "endpoint_url": EMBEDDED,
            "threads": 2, "max_attempts": 2, "connect_timeout_s": 1.0, "read_timeout_s": 3.0,
            "exists_timeout_s": 1.0, "negative_ttl_s": 0.2, "breaker_failures": 2,
            "breaker_cooldown_s": 1.0}
    config = make_config(instance, tmp_path / "run", cpu={"num_blocks": 8}, tiers=[tier],
                         supervisor={"ready_timeout_s": 60.0, "restart_backoff_s": 0.2})
    proc = start_supervisor(config, tmp_path / "node.toml.in")
    kv = engine = None
    old: dict[str, dict[str, Any]] = {}
    new: dict[str, dict[str, Any]] = {}
    secret = b""
    try:
        old = children(wait_status(config, up, proc, timeout=90))
        assert old[ENDPOINT]["endpoint"].startswith("http://127.0.0.1:")
        kv = allocate_kv_cache(instance, 0, KVLayout.blocks_outer(num_blocks=GPU_BLOCKS, **LAYOUT))
        engine = Client.from_config(config)
        engine.register_kv(0, kv.registration())
        with Client.from_config(config) as c:
            c.use_kv(engine.registration_tokens)
            lost = keys(*range(8), prefix=b"lost")
            store(c, kv, lost, list(range(8)))
            assert s3_stats(c)["blocks"] >= len(lost)

            os.kill(old[ENDPOINT]["pid"], signal.SIGKILL)
            new = children(wait_status(config, lambda s: up(s) and all(
                children(s)[n]["pid"] != old[n]["pid"] for n in (ENDPOINT, TIER)), proc,
                timeout=90))
            # Same port: the tier's endpoint_url (in the children's config) stays valid.
            assert new[ENDPOINT]["endpoint"] == old[ENDPOINT]["endpoint"]
            assert new[ENDPOINT]["restarts"] >= 1 and new[TIER]["restarts"] >= 1
            assert not alive(old[ENDPOINT]["pid"]) and not alive(old[TIER]["pid"])

            # The tier is back (its new process serves, its circuit closed), and the
            # broker no longer counts what the lost endpoint held...
            poll(c, lambda: tier_serves(c, new[TIER]["pid"]))
            assert s3_stats(c)["blocks"] == 0
            # ...new stores reach S3 (evicting `lost` from the CPU tier), and come back
            # from it with their bytes...
            fresh, newer = keys(*range(8), prefix=b"new"), keys(*range(8), prefix=b"newer")
            store(c, kv, fresh, list(range(8, 16)))
            store(c, kv, newer, list(range(16, 24)))
            load_from_s3(c, kv, fresh[:4], [24, 25, 26, 27], "r1")
            # ...and what was lost is a miss, never a hit with other bytes.
            for _ in range(20):
                assert c.lookup(lost, "r2").hits == 0
                c.step()
                time.sleep(0.05)
            c.finish("r2")
            secret = secret_of(new[TIER]["pid"])

        # The restarted endpoint got its keys over the secret pipe: not on its command
        # line, in its environment or in the log.
        exposed = (Path(f"/proc/{new[ENDPOINT]['pid']}/cmdline").read_bytes()
                   + Path(f"/proc/{new[ENDPOINT]['pid']}/environ").read_bytes())
        assert secret and secret not in exposed
        status = subprocess.run(
            [sys.executable, "-m", "tierkv.cli", "status", "-c", str(tmp_path / "node.toml.in"),
             "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
        rows = {p["process"]: p for p in json.loads(status.stdout)["processes"]}
        assert rows[ENDPOINT]["pid"] == new[ENDPOINT]["pid"]
        assert rows[ENDPOINT]["state"] == "running" and rows[ENDPOINT]["restarts"] >= 1
        assert rows[ENDPOINT]["endpoint"] == old[ENDPOINT]["endpoint"]
        table = subprocess.run(
            [sys.executable, "-m", "tierkv.cli", "status", "-c", str(tmp_path / "node.toml.in")],
            cwd=REPO, capture_output=True, text=True, timeout=60).stdout
        assert f"{ENDPOINT} serves {old[ENDPOINT]['endpoint']}" in table, table
    finally:
        if engine is not None:
            engine.close()
        code = stop_supervisor(proc)
        if kv is not None:
            kv.close()
    assert code == 0
    assert not any(alive(c["pid"]) for c in [*old.values(), *new.values()])
    assert leftovers(config.run_path, instance) == []
    text = (config.run_path / "node.log").read_text()
    assert f"{ENDPOINT} (pid {old[ENDPOINT]['pid']}) was killed by SIGKILL" in text
    assert secret.decode() not in text
