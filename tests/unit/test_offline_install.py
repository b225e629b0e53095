"""gpu-check's offline install, for real: a Python that has torch, numpy and msgpack
but nothing else of tierkv's (as a GPU machine typically does, and without pip), a
wheelhouse copied next to the checkout, every package index and proxy pointing at a
closed loopback port. The wheelhouse is made here from this environment's own
installed distributions (real wheels of the real packages), since the test must not
need the network either."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from workers.gpu.check import offline

ROOT = Path(__file__).resolve().parents[2]
#: what the machine already has: torch and its own dependencies, numpy, msgpack
PRESENT = ["torch", "filelock", "typing_extensions", "setuptools", "sympy", "mpmath",
           "networkx", "jinja2", "markupsafe", "fsspec", "numpy", "msgpack"]
#: what the wheelhouse holds: the rest, pytest's dependencies, setuptools, pip
WHEELS = ["pyzmq", "posix_ipc", "xxhash", "prometheus_client", "tqdm", "pytest",
          "pytest-timeout", "iniconfig", "pluggy", "packaging", "pygments", "setuptools",
          "pip"]
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, any attempt fails


def _files(dist: md.Distribution) -> list[tuple[str, Path]]:
    """(path in the wheel, file on disk) of an installed distribution."""
    out = []
    for f in dist.files or []:
        if f.parts[0] == ".." or "__pycache__" in f.parts or f.name == "RECORD":
            continue
        path = Path(dist.locate_file(f))
        if path.is_file():
            out.append((f.as_posix(), path))
    return out


def repack(name: str, into: Path) -> Path:
    """A wheel of the installed distribution `name`, with a fresh RECORD."""
    dist = md.distribution(name)
    tag = next(line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines()
               if line.startswith("Tag: "))
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}"
    wheel = into / f"{stem}-{tag}.whl"
    files = _files(dist)
    record_name = next(a for a, _ in files if a.endswith(".dist-info/METADATA")).rsplit(
        "/", 1)[0] + "/RECORD"
    lines = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, path in files:
            data = path.read_bytes()
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            lines.append(f"{arc},sha256={digest.decode()},{len(data)}")
        z.writestr(record_name, "\n".join([*lines, f"{record_name},,"]) + "\n")
    return wheel


def gpu_machine_python(tmp: Path) -> Path:
    """A Python without pip whose only packages are `PRESENT` (linked in by a .pth)."""
    env_dir = tmp / "py"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip())
    have = tmp / "machine-site"
    have.mkdir()
    for name in PRESENT:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for top in {arc.split("/", 1)[0] for arc, _ in _files(dist)}:
            source = Path(dist.locate_file(top))
            if not (have / top).exists():
                (have / top).symlink_to(source)
    (site / "machine.pth").write_text(f"{have}\n")
    return python


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline")
    wheels = tmp / "wheels"
    wheels.mkdir()
    for name in WHEELS:
        repack(name, wheels)
    return gpu_machine_python(tmp), wheels


def check_offline(python: Path, wheels: Path,
                  install_only: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PYTHON=str(python), TIERKV_WHEELS=str(wheels), PIP_INDEX_URL=f"{CLOSED}/simple",
               PIP_EXTRA_INDEX_URL=f"{CLOSED}/simple", http_proxy=CLOSED, https_proxy=CLOSED,
               HTTP_PROXY=CLOSED, HTTPS_PROXY=CLOSED, no_proxy="", NO_PROXY="")
    command = [str(ROOT / "scripts" / "gpu-check"), *(["--install-only"] * install_only)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_installs_what_the_machine_lacks_from_the_wheelhouse_offline(machine):
    python, wheels = machine
    probe = "import torch, numpy, msgpack\ntry:\n import zmq\nexcept ImportError: print('no zmq')"
    assert subprocess.run([python, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "no zmq"
    done = check_offline(python, wheels)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert (f"lacks: pyzmq, posix_ipc, xxhash, prometheus_client, tqdm, pytest, "
            f"pytest-timeout; wheelhouse: {wheels}") in out
    assert "--no-index" in out and "-whl/pip install" not in out
    assert f"{wheels}/pip-" in out  # this Python has no pip: pip ran from its wheel
    assert "ok: tierkv imports from /" in out and "/tierkv-gpu-check." in out


def test_the_whole_check_runs_from_the_install_target(machine):
    """What a GPU machine runs, on this CPU one: install, environment, then the copy
    engine's store and load round trip from the installed target, compared byte by
    byte (the device parts are skipped, and the output says so)."""
    python, wheels = machine
    done = check_offline(python, wheels, install_only=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "PASS  CPU engine round trip" in out and "no CUDA: skipping the device part" in out


def test_a_wheel_missing_from_the_wheelhouse_is_named_and_the_network_not_tried(machine,
                                                                                  tmp_path):
    python, wheels = machine
    partial = tmp_path / "wheels"
    partial.mkdir()
    for wheel in wheels.iterdir():
        if not wheel.name.startswith("xxhash-"):
            (partial / wheel.name).symlink_to(wheel)
    done = check_offline(python, partial)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert "xxhash" in out and "No matching distribution" in out
    assert "127.0.0.1" not in out  # no index, no proxy was contacted


def test_the_real_import_error_is_printed(tmp_path, capsys):
    broken = tmp_path / "target" / "tierkv"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libfoo.so.1: cannot open')\n")
    assert not offline.verify(str(tmp_path / "target"))
    out = capsys.readouterr().out
    assert "an import still fails" in out and "libfoo.so.1: cannot open" in out
    assert "Traceback" in out and sys.executable in out
