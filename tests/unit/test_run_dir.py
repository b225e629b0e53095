"""The run directory is this user's alone: the default one lives under a
directory every user can write, and was made with the umask's mode and trusted
without a look at its owner, so another user could make it first and read or
replace the node's sockets. Now every folder tierkv makes for it is made 0700, and
one that exists must be this user's with no access for others, or it is refused,
naming the path and what is wrong."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.node.config import config_from_dict
from tierkv.wire.sockets import RunDirError, check_run_dir, ensure_run_dir

REPO = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch) -> Path:
    """A private $XDG_RUNTIME_DIR: the default run directory goes under it."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    return xdg


@pytest.fixture
def open_umask():
    """The loosest umask: a folder made with the umask's mode would be 0777."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_the_default_run_directory_is_made_0700_at_every_level(runtime_dir, open_umask):
    run = config_from_dict({"instance": "rd"}).run_path
    assert run == runtime_dir / "tierkv" / "rd"
    ensure_run_dir(run)
    assert mode(runtime_dir / "tierkv") == mode(run) == 0o700
    assert check_run_dir(run)


def test_a_run_directory_others_can_enter_is_refused_not_repaired(runtime_dir):
    top = runtime_dir / "tierkv"
    top.mkdir()
    top.chmod(0o755)
    with pytest.raises(RunDirError) as e:
        ensure_run_dir(top / "rd")
    assert str(top) in str(e.value) and "0755" in str(e.value) and "chmod 700" in str(e.value)
    assert mode(top) == 0o755 and not (top / "rd").exists()  # nothing changed, nothing made


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user's needs root")
def test_a_run_directory_another_user_made_first_is_refused(runtime_dir):
    top = runtime_dir / "tierkv"
    top.mkdir(mode=0o700)
    os.chown(top, 65534, 65534)  # nobody's, as if they had made it first
    with pytest.raises(RunDirError) as e:
        ensure_run_dir(top / "rd")
    assert str(top) in str(e.value) and "uid 65534" in str(e.value)
    with pytest.raises(RunDirError):
        check_run_dir(top / "rd")


def test_a_symbolic_link_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "run"
    link.symlink_to(target)
    with pytest.raises(RunDirError, match="symbolic link"):
        ensure_run_dir(link)


def test_a_configured_run_directory_is_checked_itself(tmp_path, open_umask):
    run = tmp_path / "home" / "run"
    ensure_run_dir(run)
    assert mode(run) == 0o700
    run.chmod(0o750)
    with pytest.raises(RunDirError, match="0750"):
        ensure_run_dir(run)
    assert not check_run_dir(tmp_path / "missing")


def test_tierkv_up_refuses_a_bad_run_directory_before_anything_starts(tmp_path, instance):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    path = tmp_path / "node.toml"
    path.write_text(f'instance = "{instance}"\nrun_dir = "{run}"\n[worker]\nenabled = false\n')
    out = subprocess.run([sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"run directory {run} has mode 0755" in out.stderr
    assert os.listdir(run) == []
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"tierkv.{instance}")]
