"""Install tierkv and what the GPU machine's Python lacks from a copied wheelhouse,
offline, into a temporary target (the first step of ``scripts/gpu-check``).

Why: a GPU machine typically has a CUDA build of torch, numpy and msgpack, but not
pyzmq, posix_ipc, xxhash or tierkv, and may reach no package index. The Python that
already has CUDA torch is the one to use, untouched: only what it cannot import is
installed, into a folder put on PYTHONPATH for the check (nothing of the machine's
own environment changes). When the wheelhouse (``scripts/wheelhouse``) is present
the network is never used: ``--no-index``, the machine's pip configuration ignored,
and pip itself taken from the wheelhouse if this Python has none.

Standard library only: it runs before anything is installed.

    python -m workers.gpu.check.offline --root . --wheels .wheels --target /tmp/t
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

#: module to import -> distribution to install (tierkv's runtime dependencies less
#: torch, then what ``pytest tests/gpu`` needs).
REQUIRED = {
    "zmq": "pyzmq", "msgpack": "msgpack", "numpy": "numpy", "posix_ipc": "posix_ipc",
    "xxhash": "xxhash", "prometheus_client": "prometheus_client", "tqdm": "tqdm",
    "pytest": "pytest", "pytest_timeout": "pytest-timeout",
}
#: what the check imports once installed (tierkv's own packages included)
VERIFY = ["tierkv", "tierkv.engine", "tierkv.core.shm", "broker", "workers.gpu.transfer",
          *REQUIRED]
SOURCES = ("pyproject.toml", "README.md", "tierkv", "broker", "workers")
PIP_TIMEOUT_S = 300


def say(*args: object) -> None:
    print("[gpu-check] install:", *args, flush=True)


def missing_modules() -> list[str]:
    return [m for m in REQUIRED if importlib.util.find_spec(m) is None]


def pip_command(wheels: str | None) -> list[str] | None:
    """This Python's pip, else pip run from its wheel in the wheelhouse."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    found = sorted(glob.glob(os.path.join(wheels, "pip-*.whl"))) if wheels else []
    return [sys.executable, os.path.join(found[-1], "pip")] if found else None


def pip_env(offline: bool) -> dict[str, str]:
    """pip's environment: offline, the machine's pip configuration and indexes out."""
    env = dict(os.environ)
    if offline:
        for key in [k for k in env if k.startswith("PIP_")]:
            del env[key]
        env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull,
                   PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def run_pip(pip: list[str], args: list[str], offline: bool) -> bool:
    command = [*pip, "install", "--quiet", "--no-warn-script-location", *args]
    say(" ".join(command))
    try:
        done = subprocess.run(command, env=pip_env(offline), capture_output=True, text=True,
                              timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        say(f"pip did not finish within {PIP_TIMEOUT_S} s")
        return False
    if done.returncode != 0:
        say(f"pip failed (exit {done.returncode}):\n{done.stdout}{done.stderr}".rstrip())
    return done.returncode == 0


def copy_sources(root: str, into: str) -> str:
    """tierkv's sources in a scratch folder: the build writes there, not in the checkout."""
    dest = os.path.join(into, "src")
    os.makedirs(dest)
    for name in SOURCES:
        src = os.path.join(root, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name),
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest)
    return dest


def verify(target: str) -> bool:
    """Import everything the check needs from `target`, in a fresh process; print the
    real error (the whole traceback) of the first import that fails."""
    code = ("import importlib, sys\n"
            f"for name in {VERIFY!r}:\n"
            "    importlib.import_module(name)\n"
            "import tierkv\nprint(tierkv.__file__)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (target, os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, cwd=target, timeout=120)
    if done.returncode != 0:
        say(f"an import still fails with {sys.executable}:\n{done.stderr.rstrip()}")
        return False
    say(f"ok: tierkv imports from {done.stdout.strip()}")
    return True


def install(root: str, wheels: str, target: str) -> int:
    if sys.version_info < (3, 11):  # noqa: UP036 - runs on any Python, before tierkv
        say(f"tierkv needs Python >= 3.11 (enum.StrEnum, tomllib); {sys.executable} is "
            f"{sys.version.split()[0]}: point PYTHON= at a Python >= 3.11 that has torch")
        return 3
    offline = os.path.isdir(wheels)
    lacking = [REQUIRED[m] for m in missing_modules()]
    say(f"python {sys.version.split()[0]} ({sys.executable}); lacks: "
        f"{', '.join(lacking) or 'nothing'}; wheelhouse: "
        f"{wheels if offline else 'none (the package index will be used)'}")
    pip = pip_command(wheels if offline else None)
    if pip is None:
        say(f"{sys.executable} has no pip and {wheels} holds no pip wheel (run scripts/"
            "wheelhouse on a machine with network and copy .wheels/ here)")
        return 3
    source = ["--no-index", "--find-links", os.path.abspath(wheels)] if offline else []
    os.makedirs(target, exist_ok=True)
    if lacking and not run_pip(pip, [*source, "--target", target, *lacking], offline):
        return 3
    with tempfile.TemporaryDirectory(prefix="tierkv-src-") as scratch:
        src = copy_sources(root, scratch)
        if not run_pip(pip, [*source, "--target", target, "--no-deps", src], offline):
            return 3
    return 0 if verify(target) else 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="the tierkv checkout")
    p.add_argument("--wheels", required=True, help="the wheelhouse (scripts/wheelhouse)")
    p.add_argument("--target", required=True, help="the folder to install into")
    args = p.parse_args(argv)
    return install(os.path.abspath(args.root), args.wheels, os.path.abspath(args.target))


if __name__ == "__main__":
    sys.exit(main())
