"""What every part of `tierkv bench` shares: statistics, rows, the time budget, the
summary table and the JSON document.

A figure alone says little on a shared machine; a figure next to the physical
limit measured in the same run says how much of that limit the service reaches.
So every row carries its reference and the ratio between the two, and the ratio
is the headline. Where the measurement and its reference were timed back to back
in each repeat, the ratio is taken per repeat (a noisy neighbour then slows both
alike) and its median and min-max are reported; otherwise it is the ratio of the
medians, and says so (`paired` false).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

SCHEMA = 1  # version of the JSON document; bumped when a field changes meaning

# How to read a ratio. HIGHER: value / reference, the fraction of the reference
# reached (1.0 = as fast as the reference; for times, reference time / time).
# FLAT: cost at this size / cost at the smallest size (1.0 = does not grow).
HIGHER = "higher"
FLAT = "flat"


@dataclass(frozen=True)
class Options:
    """What the command line says to every part."""

    quick: bool = False  # small sizes, few repeats: that it runs, not what it shows
    repeats: int | None = None  # None: the part's own default
    disk_dir: Path = Path("/var/tmp")
    s3_endpoint: str | None = None  # None: start a local moto server
    trace: Path | None = None  # None: the shared Mooncake trace, when present

    def pick(self, quick: int, full: int) -> int:
        """The repeats to run: --repeats, else the part's quick or full default."""
        if self.repeats is not None:
            return self.repeats
        return quick if self.quick else full


@dataclass(frozen=True, slots=True)
class Stat:
    """Median and min-max of `n` samples (n == 1: a single figure, no spread)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stat:
        if not samples:
            raise ValueError("no samples")
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    @classmethod
    def one(cls, value: float) -> Stat:
        return cls(value, value, value, 1)

    def scaled(self, factor: float) -> Stat:
        return Stat(self.median * factor, self.min * factor, self.max * factor, self.n)

    def fmt(self, digits: int = 2) -> str:
        """`1.23 (1.10-1.40)`; the spread is left out for a single figure."""
        text = f"{self.median:.{digits}f}"
        if self.n > 1:
            text += f" ({self.min:.{digits}f}-{self.max:.{digits}f})"
        return text


def ratio(numerators: Sequence[float], denominators: Sequence[float],
          paired: bool = True) -> Stat:
    """Per-repeat ratios when `paired` (the two lists were measured back to back,
    one pair per repeat), else the ratio of the medians (n == 1)."""
    if paired:
        if len(numerators) != len(denominators):
            raise ValueError(f"paired ratio of {len(numerators)} and {len(denominators)} "
                             "samples")
        return Stat.of([n / d for n, d in zip(numerators, denominators, strict=True)])
    return Stat.one(statistics.median(numerators) / statistics.median(denominators))


def rates(amount: float, seconds: Sequence[float]) -> list[float]:
    """Throughput per sample: `amount` (bytes, ops, ...) over each duration."""
    return [amount / s for s in seconds]


@dataclass(frozen=True, slots=True)
class Row:
    """One measured figure, its reference and the ratio between them.

    `reference` names what the figure is compared against (measured in the same
    run); `ref_value` is that reference's own figure, in the same unit, when it
    has one. `want` says how to read the ratio (HIGHER or FLAT). Rows that are
    not `headline` are details: printed and written, left out of the summary."""

    part: str
    name: str
    value: Stat
    unit: str
    reference: str
    ratio: Stat | None
    ref_value: Stat | None = None
    want: str = HIGHER
    headline: bool = True
    paired: bool = True
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Budget:
    """The seconds one part may spend. Parts check it between measurements (a
    measurement already started runs to its end), skip what is left and say so."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def spent(self) -> bool:
        return self.left() <= 0

    def deadline(self) -> float:
        """The end of the budget on `time.monotonic`'s scale (for the scripts'
        measuring loops, which take a deadline)."""
        return time.monotonic() + self.left()


@dataclass
class Part:
    """One part's run: its rows as they are measured, what context it noted, what
    the budget made it skip, and the error that ended it, if one did."""

    name: str
    budget: Budget
    out: TextIO = sys.stdout
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        print(f"  {format_row(row)}", file=self.out, flush=True)
        return row

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  # {text}", file=self.out, flush=True)

    def over_budget(self, what: str) -> bool:
        """True (and `what` is recorded as skipped) once the budget is spent."""
        if not self.budget.spent():
            return False
        self.skip(what)
        return True

    def skip(self, what: str) -> None:
        """Record and say that the budget left `what` unmeasured."""
        self.skipped.append(what)
        print(f"  # budget of {self.budget.seconds:.0f} s spent: {what} skipped",
              file=self.out, flush=True)

    @property
    def exhausted(self) -> bool:
        return bool(self.skipped)

    @contextmanager
    def timing(self) -> Iterator[Part]:
        t0 = time.monotonic()
        try:
            yield self
        finally:
            self.seconds = time.monotonic() - t0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "seconds": round(self.seconds, 3),
            "budget_s": self.budget.seconds, "budget_exhausted": self.exhausted,
            "skipped": self.skipped, "notes": self.notes, "error": self.error,
            "rows": [r.to_dict() for r in self.rows],
        }


# -- presentation -------------------------------------------------------------------------


def _value_cell(stat: Stat, unit: str) -> str:
    size = abs(stat.median)
    digits = 0 if size >= 1000 else 1 if size >= 100 else 2 if size >= 1 else 3 if size >= 0.1 \
        else 4
    return f"{stat.fmt(digits)} {unit}".rstrip()


def _ratio_cell(row: Row) -> str:
    if row.ratio is None:
        return "-"
    text = row.ratio.fmt(2)
    if row.want == FLAT:
        text += " flat=1"
    elif not row.paired:
        text += " (of medians)"
    return text


def _reference_cell(row: Row) -> str:
    if row.ref_value is None:
        return row.reference
    return f"{row.reference} {_value_cell(row.ref_value, row.unit)}"


def format_row(row: Row) -> str:
    """One line as a part prints it while it runs."""
    line = f"{row.name}: {_value_cell(row.value, row.unit)}  vs {_reference_cell(row)}"
    line += f"  ratio {_ratio_cell(row)}"
    return line + (f"  [{row.note}]" if row.note else "")


def summary_table(parts: Sequence[Part]) -> str:
    """Every headline row of every part, one line each, ratios in the last column;
    then one line per part that ran out of budget or failed."""
    head = ("part", "measurement", "median (min-max)", "reference", "ratio (min-max)")
    cells = [head]
    for part in parts:
        for row in part.rows:
            if row.headline:
                cells.append((part.name, row.name, _value_cell(row.value, row.unit),
                              _reference_cell(row), _ratio_cell(row)))
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for part in parts:
        status = f"{part.seconds:.0f} s of {part.budget.seconds:.0f} s"
        if part.error:
            lines.append(f"{part.name}: FAILED after {status}: {part.error}")
        elif part.skipped:
            lines.append(f"{part.name}: budget spent ({status}); skipped: "
                         + "; ".join(part.skipped))
    lines.append("ratio: measured / reference (times: reference / measured), 1.0 = reaches "
                 "the reference; 'flat=1': cost at N / cost at the smallest N")
    return "\n".join(lines)


def document(parts: Sequence[Part], argv: Sequence[str],
             load_at_start: list[float] | None = None) -> dict[str, Any]:
    """The JSON document of a run. The machine is described at the end (torch is
    named once a part imported it), with the load average at the start too: the
    two together say how quiet the machine was."""
    machine = machine_info()
    if load_at_start is not None:
        machine["load_avg_start"] = load_at_start
    return {"schema": SCHEMA, "command": ["tierkv", "bench", *argv],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
            "parts": [p.to_dict() for p in parts]}


# -- the machine ----------------------------------------------------------------------------


def _proc_field(path: str, name: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        return None
    return None


def machine_info() -> dict[str, Any]:
    """What a figure depends on: CPU, cores, memory, load, versions. torch is named
    only if a part already imported it (the bench never imports it for this)."""
    mem = _proc_field("/proc/meminfo", "MemTotal")
    info: dict[str, Any] = {
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["cuda"] = (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    return info


def parse_size(text: str) -> int:
    """A size as given on a command line: 4096, 256K, 2M, 1G."""
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return int(m.group(1)) * {"": 1, "K": 1024, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


@contextmanager
def work_dir(parent: Path, prefix: str = "tierkv-bench-") -> Iterator[Path]:
    """A fresh directory under `parent` (on the filesystem to measure), removed after."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=parent,
                                     ignore_cleanup_errors=True) as work:
        yield Path(work)
