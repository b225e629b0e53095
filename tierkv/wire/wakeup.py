"""A pipe that wakes a poll loop when a worker thread finished something.

The worker-side processes poll their broker socket; copies and tier I/O finish on
other threads. Instead of polling for results every millisecond (which on a small
machine steals the CPU those threads need), a thread that finishes a job writes a
byte here and the loop, which polls this fd with its socket, wakes at once.
"""

from __future__ import annotations

import os


class Wakeup:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def fd(self) -> int:
        """Readable when `notify` was called since the last `drain`."""
        return self._r

    def notify(self) -> None:
        """Any thread; never blocks (a full pipe already means "wake up")."""
        try:
            os.write(self._w, b"!")
        except (BlockingIOError, OSError):
            pass

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1
