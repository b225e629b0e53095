"""Durability of the disk tier's writes: one `fdatasync` shared by the stores that
are waiting for it (group commit)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Round:
    fds: set[int] = field(default_factory=set)
    done: bool = False
    error: OSError | None = None


class GroupCommit:
    """Makes finished writes durable with as few `fdatasync` calls as possible.

    A writer joins the open round after its `pwritev` returned, then waits. The
    first waiter finding no sync running leads the round: it closes it (later writers
    join the next one), syncs every file the round touched, and wakes everybody. So
    while one fdatasync runs, the writers finishing meanwhile share the next one.
    With `grouped=False` every writer syncs on its own (for measurements).
    """

    def __init__(self, durable: bool = True, grouped: bool = True) -> None:
        self.durable = durable
        self.grouped = grouped
        self.writes = 0
        self.syncs = 0
        self._cond = threading.Condition()
        self._open = _Round()
        self._syncing = False

    def commit(self, fd: int) -> None:
        """Return once everything written to `fd` before this call is durable."""
        if not self.durable:
            return
        if not self.grouped:
            os.fdatasync(fd)
            with self._cond:
                self.writes += 1
                self.syncs += 1
            return
        with self._cond:
            self.writes += 1
            rnd = self._open
            rnd.fds.add(fd)
            while not rnd.done:
                if self._syncing:
                    self._cond.wait()
                else:
                    self._lead(rnd)
        if rnd.error is not None:
            raise rnd.error

    def _lead(self, rnd: _Round) -> None:
        """Sync `rnd` (called holding the condition; releases it during the I/O)."""
        self._syncing = True
        self._open = _Round()
        self._cond.release()
        try:
            for fd in rnd.fds:
                os.fdatasync(fd)
        except OSError as e:
            rnd.error = e
        finally:
            self._cond.acquire()
            rnd.done = True
            self._syncing = False
            self.syncs += 1
            self._cond.notify_all()

