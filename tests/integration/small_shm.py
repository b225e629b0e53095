"""Scenarios run inside a private mount namespace whose /dev/shm is a small tmpfs.

`tests/integration/test_shm_restart_reclaim.py` starts each one as
`python -m tests.integration.small_shm <scenario> <instance> <run_dir>` under
`unshare -m`, after mounting the tmpfs: the namespace has to exist before Python
starts, so the scenario is a process of its own. Each prints one JSON line of what
it saw (the test asserts on it) and ends every process it started by pid.

The tmpfs is 10 MiB and the CPU tier 6 MiB: more than half of it, so a dead owner's
region left in place leaves too little room for the same region again.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integration.cluster import LAYOUT, keys, make_config
from tierkv.core.shm import RegionError, SharedRegion, region_name

MiB = 2**20
TIER_BLOCKS = 6  # blocks of 1 MiB: 6 MiB and a header page, more than half of /dev/shm
WAIT_S = 60.0  # a process start or a broker restart on 2 noisy cores

# Creates a prefaulted region (its pages count as used in /dev/shm, as a broker's
# do), says so, and holds it until it is killed; or says why it was refused.
OWNER = """
import sys
from tierkv.core.shm import RegionError, SharedRegion
try:
    SharedRegion.create(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), prefault=True)
except RegionError as e:
    print(f"refused {type(e).__name__}: {e}", flush=True)
    raise SystemExit(3)
print("created", flush=True)
sys.stdin.read()
"""


def shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def segment_exists(instance: str) -> bool:
    return os.path.exists(f"/dev/shm{region_name(instance)}")


def outcome(create: Callable[[], SharedRegion]) -> tuple[SharedRegion | None, str]:
    """The region `create` made and "created", or None and the error it raised."""
    try:
        return create(), "created"
    except RegionError as e:
        return None, f"refused {type(e).__name__}: {e}"


def start_owner(instance: str, blocks: int) -> tuple[subprocess.Popen[str], str]:
    """A process that creates a region of `blocks` MiB, and the line it answered."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, instance, str(blocks), str(MiB)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
    line = proc.stdout.readline().strip() if ready else f"no answer in {WAIT_S}s"
    return proc, line


def end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def restart(instance: str, run_dir: Path) -> dict[str, Any]:
    """An owner killed by SIGKILL leaves its region; the next create of the instance
    takes its place."""
    owner, answer = start_owner(instance, TIER_BLOCKS)
    end(owner)
    seen: dict[str, Any] = {"first": answer, "left_after_kill": segment_exists(instance),
                            "free_after_kill": shm_free()}
    region, seen["again"] = outcome(
        lambda: SharedRegion.create(instance, TIER_BLOCKS, MiB, prefault=True))
    if region is not None:
        seen["blocks"] = region.layout.num_blocks
        with region:
            pass
    return seen


def live(instance: str, run_dir: Path) -> dict[str, Any]:
    """A second creator of an instance whose owner is alive is refused, and the
    owner's region and bytes stay as they were."""
    seen: dict[str, Any] = {}
    with SharedRegion.create(instance, TIER_BLOCKS, MiB, prefault=True) as region:
        region.numpy_page(TIER_BLOCKS - 1)[:] = 0x5A
        generation = region.generation
        second, seen["second"] = start_owner(instance, TIER_BLOCKS)
        end(second)
        seen["kept"] = segment_exists(instance) and region.generation == generation
        seen["bytes_kept"] = bool((region.numpy_page(TIER_BLOCKS - 1) == 0x5A).all())
    return seen


def too_large(instance: str, run_dir: Path) -> dict[str, Any]:
    """What truly does not fit is refused at the first start: a region larger than
    the whole tmpfs, and one that another instance's live region leaves no room for."""
    seen: dict[str, Any] = {}
    _, seen["larger_than_shm"] = outcome(lambda: SharedRegion.create(instance, 11, MiB))
    with SharedRegion.create(instance + "x", TIER_BLOCKS, MiB, prefault=True):
        _, seen["beside_another"] = outcome(
            lambda: SharedRegion.create(instance, TIER_BLOCKS, MiB))
    return seen


# -- a real node ------------------------------------------------------------------------


def node_status(status_path: Path, supervisor: subprocess.Popen[bytes]) -> dict[str, Any]:
    if supervisor.poll() is not None:
        raise RuntimeError(f"the supervisor exited with {supervisor.returncode}")
    try:
        status = json.loads(status_path.read_text())
    except (OSError, ValueError):
        return {}
    return status if status.get("pid") == supervisor.pid else {}


def wait_children(status_path: Path, supervisor: subprocess.Popen[bytes],
                  ready: Callable[[dict[str, dict[str, Any]]], bool]) -> dict[str, Any]:
    """The children (by name) once `ready` holds of them, or {} after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        children = {c["name"]: c for c in node_status(status_path, supervisor).get(
            "children", [])}
        if children and ready(children):
            return children
        time.sleep(0.2)
    return {}


def all_alive(children: dict[str, dict[str, Any]]) -> bool:
    return all(c["alive"] for c in children.values()) and "broker" in children


def wait_new_broker(config: Any, old_pid: int) -> int | None:
    """The pid of a broker other than `old_pid` once it answers and the worker (with
    the engine's KV cache) and the tier said hello to it; None if not within WAIT_S."""
    from tierkv.client import BrokerUnavailable, Client

    deadline = time.monotonic() + WAIT_S
    with Client.from_config(config) as client:
        while time.monotonic() < deadline:
            try:
                stats = client.stats()
            except BrokerUnavailable:
                continue  # a broker that is not up (yet): the client waited its timeout
            ready = {p["kind"] for p in stats["peers"] if p["state"] == "ready"
                     and p.get("kv_attached", True)}
            if stats["pid"] != old_pid and ready >= {"worker", "tier"}:
                return int(stats["pid"])
            time.sleep(0.2)
    return None


def round_trip(config: Any, kv: Any, engine: Any) -> dict[str, Any]:
    """Store two blocks from the engine's KV cache, look them up, load them back."""
    from tierkv.client import Client

    block_keys = keys(1, 2, prefix=b"reclaim")
    view = kv.tensors[0].view(32, -1)
    view[:2] = 7
    with Client.from_config(config) as c:
        c.use_kv(engine.registration_tokens)
        store = c.store(block_keys, [0, 1])
        stored = c.wait([store.job_id], timeout=30)[store.job_id].success
        view[:2] = 0
        hits = c.lookup(block_keys).hits
        load = c.load(block_keys, [0, 1])
        loaded = c.wait([load.job_id], timeout=30)[load.job_id].success
    return {"stored": stored, "hits": hits, "loaded": loaded,
            "bytes_back": bool((view[:2] == 7).all())}


def node(instance: str, run_dir: Path) -> dict[str, Any]:
    """`tierkv up` with a 6 MiB CPU tier; its broker is SIGKILLed; the supervisor's
    restart serves again."""
    from tierkv.client import Client
    from tierkv.engine import KVLayout, allocate_kv_cache
    from tierkv.node.config import dump_config

    # 1536 blocks of 1 KiB, each row padded to 4 KiB: a region of 6 MiB. The worker
    # and the tier attach the dead broker's region again while they wait for a
    # welcome (supervisor.ready_timeout_s), and its pages are only free once they let
    # go: short waits here, so the restart that fits comes within seconds of that.
    config = make_config(instance, run_dir / "run",
                         cpu={"num_blocks": 1536, "page_size": 1024},
                         supervisor={"ready_timeout_s": 10.0, "restart_backoff_max_s": 1.0},
                         tiers=[{"type": "memory", "name": "mem", "capacity_blocks": 64}])
    path = run_dir / "node.toml.in"
    path.write_text(dump_config(config))
    status_path = config.run_path / "supervisor.json"
    seen: dict[str, Any] = {}
    supervisor = subprocess.Popen([sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kv = engine = None
    try:
        first = wait_children(status_path, supervisor, all_alive)
        seen["started"] = bool(first)
        if not first:
            return seen
        kv = allocate_kv_cache(instance, 0, KVLayout.blocks_outer(num_blocks=32, **LAYOUT))
        engine = Client.from_config(config)
        engine.register_kv(0, kv.registration())
        old = first["broker"]["pid"]
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        new = wait_new_broker(config, old)
        seen["broker_back"] = new is not None
        seen["back_after_s"] = round(time.monotonic() - killed, 1)
        if new is not None:
            children = wait_children(status_path, supervisor,
                                     lambda cs: cs["broker"]["pid"] == new)
            seen["broker_restarts"] = children["broker"]["restarts"] if children else 0
            seen |= round_trip(config, kv, engine)
            status = subprocess.run([sys.executable, "-m", "tierkv.cli", "status", "-c",
                                     str(path)], capture_output=True, text=True, timeout=60)
            seen["status_rc"] = status.returncode
    finally:
        if engine is not None:
            engine.close()
        seen["stop_rc"] = stop(supervisor)
        if kv is not None:
            kv.close()
        log_path = config.run_path / "node.log"
        seen["log_tail"] = log_path.read_text()[-3000:] if log_path.exists() else ""
    return seen


def stop(supervisor: subprocess.Popen[bytes]) -> int:
    if supervisor.poll() is None:
        supervisor.send_signal(signal.SIGTERM)
    try:
        return supervisor.wait(30)
    except subprocess.TimeoutExpired:
        supervisor.kill()
        return supervisor.wait(10)


SCENARIOS: dict[str, Callable[[str, Path], dict[str, Any]]] = {
    "restart": restart, "live": live, "too_large": too_large, "node": node,
}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in SCENARIOS:
        print(f"usage: small_shm {{{','.join(SCENARIOS)}}} INSTANCE RUN_DIR", file=sys.stderr)
        return 2
    scenario, instance, run_dir = argv
    seen = SCENARIOS[scenario](instance, Path(run_dir))
    seen["left_in_shm"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
