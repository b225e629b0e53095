"""What the supervisor says about a child's death: the exit code, or the signal that
killed it by name, and for a signal with a usual cause on this service, that cause.

A worker or tier process maps the shared region; with `cpu.prefault = false` its
pages are allocated on first touch, and a /dev/shm that filled since the start
has none to give: the kernel sends SIGBUS, the process dies at once (no Python
traceback, no last line), and dies again after every restart. Its log then says
nothing of why, so the supervisor says it, once per node run: the same advice at
every restart would bury the deaths themselves.
"""

from __future__ import annotations

import os
import signal

from tierkv.node.config import format_bytes

SHM_DIR = "/dev/shm"


def describe_exit(code: int) -> str:
    """ "exited with code 1", or "was killed by SIGBUS" for a negative code (a
    Popen returncode of -N is a death by signal N)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}"


def shm_space(path: str = SHM_DIR) -> str:
    """ "1.2 GiB free of 32.0 GiB" for the filesystem at `path`, or why it is unknown."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return f"free space unknown ({e.strerror})"
    return (f"{format_bytes(st.f_bavail * st.f_frsize)} free of "
            f"{format_bytes(st.f_blocks * st.f_frsize)}")


def likely_cause(code: int, prefault: bool) -> str | None:
    """The usual cause of a death by this signal here, or None when there is none
    worth saying. Only SIGBUS has one: a page of a shared mapping that could not
    be allocated, /dev/shm being full."""
    if code != -signal.SIGBUS:
        return None
    advice = ("free space there or shrink cpu.num_blocks" if prefault else
              "free space there, shrink cpu.num_blocks, or set cpu.prefault = true so "
              "that a region without room fails at start instead")
    return (f"SIGBUS here most likely means the shared memory is exhausted: a page of "
            f"the shared region could not be allocated; {SHM_DIR} has {shm_space()}; "
            f"{advice}")
