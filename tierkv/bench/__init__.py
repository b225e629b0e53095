"""`tierkv bench`: every benchmark in one command, as ratios to the limits.

    tierkv bench [PART ...] [--quick] [--budget SECONDS] [--repeats N] [--json [FILE]]
                 [--disk-dir DIR] [--s3-endpoint URL] [--trace PATH]

PART is one or more of datapath, disk, s3, control, scaling, policies, or all (the
default); `peers`, `vllm`, `engine` and `engines` are opt-in, run only when named
(`peers`: tierkv beside LMCache and vLLM, in an environment of their own that its
first run builds; `vllm`: tierkv inside vLLM's scheduler, with vLLM installed;
`engine`: a real vLLM engine on the CPU with and without tierkv, in the environment
`scripts/test` builds for tests/engine; `engines`: 1 to 8 engine processes, vLLM's
scheduler each, on one broker, and the broker's CPU per engine step; see
docs/benchmarks.md).
Each part measures the service against the physical limit next to it,
in the same run (a plain memcpy, pwrite/dd on the same filesystem, boto3 on the
same endpoint, the in-process manager, the smallest size), prints its rows as it
goes, and stops measuring when its time budget is spent, saying what it skipped.
The summary table at the end lists every headline ratio; `--json` writes every
row (to stdout when no FILE is given; the progress then goes to stderr).

The measuring code is the benchmark scripts' (`tierkv/bench/*.py`, each still
runnable alone): the parts here choose sizes, keep the budget and turn what the
scripts measure into rows.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from collections.abc import Sequence
from contextlib import redirect_stdout
from pathlib import Path
from typing import TextIO

from tierkv.bench.common import Budget, Options, Part, document, machine_info, summary_table

# Part name -> module with `run(part: Part, opts: Options) -> None`, imported only
# when the part runs (datapath imports torch, s3 boto3).
PARTS = {
    "datapath": "tierkv.bench.datapath",
    "disk": "tierkv.bench.disk",
    "s3": "tierkv.bench.s3",
    "control": "tierkv.bench.control",
    "scaling": "tierkv.bench.scaling",
    "policies": "tierkv.bench.policies",
}
# Opt-in parts: run only when named, never by `all`.
OPT_IN = {"peers": "tierkv.bench.peers", "vllm": "tierkv.bench.vllm",
          "engine": "tierkv.bench.engine", "engines": "tierkv.bench.engines"}
DEFAULT_BUDGET_S = 180.0
# Parts whose default budget is not DEFAULT_BUDGET_S (peers builds an environment).
PART_BUDGETS = {"peers": 1200.0, "vllm": 900.0, "engine": 1800.0, "engines": 900.0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierkv bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="PART",
                        help=f"{', '.join(PARTS)} or all (default: all); opt-in: "
                             f"{', '.join(OPT_IN)}")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few repeats: checks that every part runs")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="time for each part; what is left when it is spent is skipped "
                             f"(default {DEFAULT_BUDGET_S:.0f}; peers "
                             f"{PART_BUDGETS['peers']:.0f})")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repeats per figure (default: each part's own, 5 or 3)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write every row as JSON to FILE (- or no FILE: stdout; "
                             "name the parts before --json)")
    parser.add_argument("--disk-dir", type=Path, default=Path("/var/tmp"),
                        help="a directory on the filesystem the disk part measures")
    parser.add_argument("--s3-endpoint", default=None, metavar="URL",
                        help="an S3 endpoint on loopback (default: start a local moto)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="Mooncake trace for the policies part (default: the shared one)")
    return parser


def select_parts(names: Sequence[str]) -> list[str]:
    """The parts to run, in the canonical order; 'all' or nothing means all the
    parts that are not opt-in, which run only when named (after the others)."""
    unknown = [n for n in names if n != "all" and n not in PARTS and n not in OPT_IN]
    if unknown:
        raise ValueError(f"unknown part {unknown[0]!r}; known: {', '.join(PARTS)}, all, "
                         f"{', '.join(OPT_IN)}")
    chosen = list(PARTS) if not names or "all" in names else [p for p in PARTS if p in names]
    return chosen + [p for p in OPT_IN if p in names]


def run_part(name: str, opts: Options, budget_s: float, out: TextIO) -> Part:
    """One part, its failure recorded rather than raised, so that `all` goes on
    to the next part."""
    part = Part(name, Budget(budget_s), out)
    print(f"\n== {name} (budget {budget_s:.0f} s)", file=out, flush=True)
    try:
        with part.timing():
            importlib.import_module({**PARTS, **OPT_IN}[name]).run(part, opts)
    except Exception as e:  # a failed part must not stop the others
        part.error = f"{type(e).__name__}: {e}"
        traceback.print_exc(file=out)
    return part


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = select_parts(args.parts)
    except ValueError as e:
        parser.error(str(e))
    if (args.budget is not None and args.budget <= 0) or (
            args.repeats is not None and args.repeats < 1):
        parser.error("--budget must be positive and --repeats at least 1")
    opts = Options(quick=args.quick, repeats=args.repeats, disk_dir=args.disk_dir,
                   s3_endpoint=args.s3_endpoint, trace=args.trace)
    to_stdout = args.json == "-"
    out = sys.stderr if to_stdout else sys.stdout
    # The scripts' measuring functions print their own progress lines: they go
    # where ours go, so that stdout holds only the JSON when it was asked there.
    with redirect_stdout(out):
        info = machine_info()
        print(f"tierkv bench {' '.join(argv)}".rstrip(), file=out)
        print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), file=out)
        parts = [run_part(name, opts, args.budget or PART_BUDGETS.get(name, DEFAULT_BUDGET_S),
                          out) for name in names]
        print("\n== summary\n" + summary_table(parts), file=out, flush=True)
    doc = document(parts, argv, info["load_avg"])
    if to_stdout:
        json.dump(doc, sys.stdout, indent=1)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"rows written to {args.json}", file=out)
    return 1 if any(p.error for p in parts) else 0
