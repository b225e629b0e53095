"""The peers' environment: one virtualenv, built once, with each peer at a pinned version.

    python -m tierkv.bench.peers.env [--rebuild] [--dir DIR]

The peers are never imported into tierkv's process and never installed into
tierkv's own environment: they pull in a different torch stack, CUDA wheels and
dozens of packages tierkv does not want. They live in a virtualenv under
`${XDG_CACHE_HOME:-~/.cache}/tierkv/peers/`, built by this module the first time
`tierkv bench peers` runs and reused after that: a stamp file names the versions
it holds, and a stamp that does not match the pins below means a rebuild.

What goes in, and why:

* `torch==2.13.0`: the CPU build these machines keep on disk (a bare `torch`
  would download several GB of CUDA wheels). Installed in the same pip call as
  LMCache so that LMCache's own `torch` requirement resolves to it.
* `lmcache==0.5.6` with its dependencies (the environment takes 3.8 GB; its CUDA wheels are
  installed but unused on a CPU-only machine).
* `vllm==0.33.0 --no-deps`: its dependency list asks for torch 2.14, flashinfer,
  CUDA kernels and more, none of which the offloading managers need. Only the
  pure-Python modules that importing the offloading path needs are added, at the
  versions vLLM's own metadata asks for (`VLLM_MODULES`); any further module an
  import still misses is found by trying the imports (`probe_missing`).

A peer that cannot be installed or imported is recorded with the reason, and its
rows say `skipped: <reason>`; the other peer is still measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.bench.peers.procs import tail

TORCH = "torch==2.13.0"
PINS = {"lmcache": "0.5.6", "vllm": "0.33.0"}
STAMP_NAME = "tierkv-peers.json"
# Bumped when what the environment must hold changes (a module added, ...).
LAYOUT = 2
PIP_TIMEOUT_S = 900.0
IMPORT_TIMEOUT_S = 300.0

# Importable module -> the package that provides it: vLLM's scheduler and offloading
# path imports these (found by trying the imports in a fresh environment); the
# version specifier comes from vLLM's own metadata where it names one.
VLLM_MODULES = {
    "cbor2": "cbor2",
    "openai_harmony": "openai-harmony",
    "openai": "openai",
    "PIL": "pillow",
    "pybase64": "pybase64",
    "cloudpickle": "cloudpickle",
    "uvloop": "uvloop",
    "xgrammar": "xgrammar",
    "partial_json_parser": "partial-json-parser",
    "llguidance": "llguidance",
}
# What each peer's driver imports: the probe that says the peer is usable.
PROBES = {
    "lmcache": ("import lmcache.v1.storage_backend.storage_manager, "
                "lmcache.v1.storage_backend.local_disk_backend"),
    "vllm": ("import vllm.v1.kv_offload.cpu.manager, "
             "vllm.v1.kv_offload.tiering.fs.manager"),
}
MAX_PROBE_ROUNDS = 12  # modules found missing one at a time, at most this many

# Environment for every process run from the peers' environment: no telemetry,
# no usage reports, nothing fetched from a model hub.
QUIET_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tierkv" / "peers"


def wanted() -> dict[str, object]:
    """What a built environment's stamp must say."""
    return {"layout": LAYOUT, "python": "3.11", "torch": TORCH.split("==")[1], **PINS}


@dataclass
class PeerEnv:
    """The environment as found or built: its python, and per peer either its
    version or why it cannot run."""

    root: Path
    python: Path
    versions: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    built_s: float = 0.0  # seconds this call spent building (0: reused)
    log: Path | None = None

    def usable(self, peer: str) -> bool:
        return peer in self.versions and peer not in self.skipped

    def process_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
        env.update(QUIET_ENV)
        env["PATH"] = f"{self.python.parent}{os.pathsep}{env.get('PATH', '')}"
        return env


class EnvError(RuntimeError):
    """The environment could not be built at all (no Python 3.11, no venv)."""


def find_python311() -> str:
    for candidate in (os.environ.get("TIERKV_PEERS_PYTHON", ""), "python3.11"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate) or candidate
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    raise EnvError("the peers' environment needs Python 3.11 on PATH (python3.11), or "
                   "TIERKV_PEERS_PYTHON=/path/to/python3.11")


def _run(cmd: Sequence[str], log: Path, env: dict[str, str], timeout: float) -> int:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            out.write(f"timed out after {timeout:.0f} s\n")
            return 124


def _tail(log: Path) -> str:
    return tail(log, lines=3, skip="is ignored")


def probe(python: Path, peer: str, env: dict[str, str]) -> tuple[bool, str]:
    """Does the peer's driver import work? (True, version) or (False, last error line)."""
    code = f"{PROBES[peer]}\nimport importlib.metadata as m; print(m.version({peer!r}))"
    try:
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                              env=env, timeout=IMPORT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return False, f"importing {peer} took over {IMPORT_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return True, done.stdout.strip().splitlines()[-1]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return False, lines[-1] if lines else f"exit status {done.returncode}"


def missing_module(error: str) -> str | None:
    found = re.search(r"No module named '([^'.]+)", error)
    return found.group(1) if found else None


def vllm_specifiers(python: Path) -> dict[str, str]:
    """Package name -> requirement as vLLM's installed metadata states it."""
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps(m.requires('vllm') or []))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          timeout=IMPORT_TIMEOUT_S, check=False)
    out: dict[str, str] = {}
    if done.returncode != 0:
        return out
    for req in json.loads(done.stdout):
        if "extra ==" in req:
            continue
        req = req.split(";")[0].strip()
        name = re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0]
        out[name.lower().replace("_", "-")] = req.replace(" ", "")
    return out


def _install_vllm(python: Path, log: Path, env: dict[str, str]) -> str | None:
    """vLLM without its dependencies, then the modules its offloading path imports.
    Returns None when it imports, else the reason it does not."""
    pip = [str(python), "-m", "pip", "install", "-q"]
    if _run([*pip, "--no-deps", f"vllm=={PINS['vllm']}"], log, env, PIP_TIMEOUT_S):
        return f"pip install --no-deps vllm=={PINS['vllm']} failed: {_tail(log)}"
    specs = vllm_specifiers(python)

    def requirement(package: str) -> str:
        return specs.get(package.lower().replace("_", "-"), package)

    modules = [requirement(p) for p in VLLM_MODULES.values()]
    if _run([*pip, *modules], log, env, PIP_TIMEOUT_S):
        return f"installing vLLM's scheduler modules failed: {_tail(log)}"
    for _ in range(MAX_PROBE_ROUNDS):
        ok, said = probe(python, "vllm", env)
        if ok:
            return None
        module = missing_module(said)
        if module is None:
            return f"vllm does not import: {said}"
        package = VLLM_MODULES.get(module, module)
        with open(log, "a") as out:
            out.write(f"vllm import misses {module!r}: installing {package}\n")
        if _run([*pip, requirement(package)], log, env, PIP_TIMEOUT_S):
            return f"vllm needs module {module!r}, and installing {package} failed"
    return f"vllm still misses modules after {MAX_PROBE_ROUNDS} rounds: {said}"


def build(root: Path, log: Path) -> dict[str, str]:
    """Create the virtualenv at `root/venv` and install the peers. Returns the
    skip reason of each peer that could not be installed."""
    venv = root / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    env = {**os.environ, **QUIET_ENV}
    if _run([find_python311(), "-m", "venv", str(venv)], log, env, 300):
        raise EnvError(f"cannot create a virtualenv at {venv}: {_tail(log)}")
    python = venv / "bin" / "python"
    skipped: dict[str, str] = {}
    pip = [str(python), "-m", "pip", "install", "-q"]
    if _run([*pip, TORCH, f"lmcache=={PINS['lmcache']}"], log, env, PIP_TIMEOUT_S):
        skipped["lmcache"] = f"pip install lmcache=={PINS['lmcache']} failed: {_tail(log)}"
        if _run([*pip, TORCH, "numpy"], log, env, PIP_TIMEOUT_S):
            raise EnvError(f"cannot install {TORCH} into {venv}: {_tail(log)}")
    reason = _install_vllm(python, log, env)
    if reason:
        skipped["vllm"] = reason
    return skipped


def read_stamp(root: Path) -> dict[str, object] | None:
    try:
        return json.loads((root / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def existing(root: Path | None = None) -> PeerEnv | None:
    """The environment as built, when it is there and its stamp matches the pins;
    None otherwise. Never builds (for benchmarks that only use it if present)."""
    root = root or cache_root()
    python = root / "venv" / "bin" / "python"
    stamp = read_stamp(root)
    if stamp is None or stamp.get("wanted") != wanted() or not python.exists():
        return None
    return PeerEnv(root, python, log=root / "build.log",
                   versions=dict(stamp.get("versions") or {}),  # type: ignore[call-overload]
                   skipped=dict(stamp.get("skipped") or {}))  # type: ignore[call-overload]


def ensure(root: Path | None = None, rebuild: bool = False,
           echo: object = None) -> PeerEnv:
    """The peers' environment: reused when its stamp matches the pins, else built
    (minutes) and each peer probed by importing what its driver imports. A reused
    environment is not probed again (that costs seconds per peer): a peer that no
    longer imports fails when its driver starts, and says why there."""
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    if not rebuild and (found := existing(root)) is not None:
        return found
    python = root / "venv" / "bin" / "python"
    log = root / "build.log"
    result = PeerEnv(root, python, log=log)
    if echo:
        print(f"  # building the peers' environment in {root} (log: {log})",
              file=echo, flush=True)  # type: ignore[call-overload]
    (root / STAMP_NAME).unlink(missing_ok=True)
    log.write_text("")
    t0 = time.monotonic()
    result.skipped = build(root, log)
    env = result.process_env()
    to_probe = [peer for peer in PINS if peer not in result.skipped]
    with ThreadPoolExecutor(max_workers=len(PINS)) as pool:  # each import takes seconds
        probes = dict(zip(to_probe, pool.map(lambda p: probe(python, p, env), to_probe),
                          strict=True))
    for peer, (ok, said) in probes.items():
        if not ok:
            result.skipped[peer] = f"{peer} does not import: {said}"
        elif said != PINS[peer]:
            result.skipped[peer] = f"{peer} {said} installed, {PINS[peer]} pinned"
        else:
            result.versions[peer] = said
    result.built_s = time.monotonic() - t0
    stamp = {"wanted": wanted(), "versions": result.versions, "skipped": result.skipped,
             "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "build_s": round(result.built_s, 1)}
    (root / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help=f"where the environment lives (default {cache_root()})")
    parser.add_argument("--rebuild", action="store_true", help="build it again from scratch")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        env = ensure(args.dir, args.rebuild, echo=sys.stdout)
    except EnvError as e:
        print(f"tierkv bench peers: {e}", file=sys.stderr)
        return 1
    print(f"peers' environment: {env.python} ({time.monotonic() - t0:.0f} s)")
    for peer in PINS:
        print(f"  {peer}: {env.versions.get(peer) or 'skipped: ' + env.skipped[peer]}")
    return 0 if not env.skipped else 1


if __name__ == "__main__":
    raise SystemExit(main())
