"""What this process's page tables map of a shared-memory view."""

from __future__ import annotations

import numpy as np


def mapped_kib(view: np.ndarray) -> int:
    """Kilobytes of the mapping holding `view` that this process's page tables map
    (its Rss in /proc/self/smaps): pages a copy would not fault in first."""
    address = view.ctypes.data
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the view")
