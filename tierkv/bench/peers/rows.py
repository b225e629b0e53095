"""The row builder: a run's record of comparisons turned into the bench's rows.

A run records, per comparison, tierkv's samples and each peer's (or why a peer
has none), as plain JSON: `tierkv bench peers` writes it next to its rows, and
`tests/unit/test_bench_peers.py` checks this module on a recorded one. Each peer
becomes one row: tierkv's figure, the peer's as the reference, and the margin as
the ratio, read so that above 1.0 means tierkv is ahead:

* `better == "higher"` (throughput, blocks found, hit ratio): tierkv / peer;
* `better == "lower"` (time, disk use over the bound): peer / tierkv.

Per-repeat ratios (`paired`) when both sides were measured back to back in each
repeat, else the ratio of the medians. A ratio with a zero in it is no number:
the row has none and the note says what happened. Where a goal applies the note
says whether it is met; where tierkv is behind, the note says why and what it
would take (`BEHIND`).
"""

from __future__ import annotations

from typing import Any

from tierkv.bench.common import Row, Stat, ratio

PART = "peers"
HIGHER, LOWER = "higher", "lower"

# (comparison id prefix, peer key prefix, least margin) from the goals.
GOALS: list[tuple[str, str, float]] = [
    ("disk.store.", "lmcache", 2.0),
    ("disk.load.", "lmcache", 1.5),
    ("disk.store.", "vllm", 1.2),  # every disk row ahead of every peer by 1.2x
    ("disk.load.", "vllm", 1.2),
    ("manager.inprocess.", "vllm", 2.0),
    ("policy.conversation.4000.default.", "vllm:lru", 1.5),  # tierkv's default policy
]
# A margin below this is a row tierkv loses (hit ratios of equal policies differ
# in the last digits by tie-breaking alone).
EVEN = 0.99
# (comparison id prefix, peer key prefix, why tierkv is behind and what it would
# take): used only on rows tierkv loses, so a row it wins never carries one.
BEHIND: list[tuple[str, str, str]] = [
    ("disk.store.", "vllm", "both are held by the disk's first writes to newly allocated "
     "blocks (a filesystem mounted with discard hands out no written block twice); tierkv "
     "also copies each block into its staging buffer and checksums it, which a CPU busy "
     "with other work slows: `staging = false` where the disk takes scattered pages well, "
     "or more `threads`"),
    ("disk.load.", "vllm", "both read with O_DIRECT; tierkv also verifies every block and "
     "copies it out of its staging buffer: more `threads`, or larger `run_bytes`"),
    ("disk.load.", "lmcache", "LMCache reads whole files through the page cache, whose "
     "read-ahead helps large blocks; tierkv reads with O_DIRECT and verifies: larger runs "
     "(`run_bytes`) are its read-ahead"),
    ("disk.restart.time", "vllm", "vLLM builds no index: it checks a file's existence when "
     "a key is looked up, so a restart costs nothing until then; tierkv reads every slot "
     "header of its slabs at start (its whole capacity, not just the blocks written) to "
     "know its inventory: scanning only slots ever written, or scanning while serving, "
     "would close it"),
    ("manager.broker.", "vllm", "a process hop and the wire protocol per engine step, "
     "against vLLM's manager inside the scheduler: the faster wire protocol being written, "
     "or larger steps"),
    ("manager.inprocess.", "vllm", "per-request Python overhead of the manager"),
    ("policy.", "", "on this trace at this size the peer's policy keeps more of what "
     "returns; tierkv's policies differ in admission and order (every one is in the table), "
     "and a better one, once registered, is measured here by itself"),
    ("cpu.", "lmcache", "the first store through a fresh node pays the page faults of its "
     "shared region; LMCache's pool is allocated and touched at start"),
    ("disk.bound", "", "tierkv's slots hold a 4 KiB header, so the same bytes hold fewer "
     "blocks"),
]


def _stat(samples: list[float]) -> Stat:
    return Stat.of(samples)


def margin(tierkv: list[float], peer: list[float], better: str, paired: bool) -> Stat | None:
    """How far ahead tierkv is (> 1: ahead), or None when a side is zero."""
    if not tierkv or not peer:
        return None
    paired = paired and len(tierkv) == len(peer)
    num, den = (tierkv, peer) if better == HIGHER else (peer, tierkv)
    if paired:
        if any(d == 0 or n == 0 for n, d in zip(num, den, strict=True)):
            return None
        return ratio(num, den, paired=True)
    medians = _stat(num).median, _stat(den).median
    if 0 in medians:
        return None
    return ratio(num, den, paired=False)


def goal_for(cid: str, peer_key: str) -> float | None:
    for prefix, peer_prefix, least in GOALS:
        if cid.startswith(prefix) and peer_key.startswith(peer_prefix):
            return least
    return None


def _note(comparison: dict[str, Any], peer: dict[str, Any], margin_stat: Stat | None) -> str:
    parts = [text for text in (comparison["tierkv"].get("note", ""), peer.get("note", ""))
             if text]
    least = goal_for(comparison["id"], peer["key"])
    if margin_stat is not None and least is not None:
        met = "met" if margin_stat.median >= least else "NOT met"
        parts.append(f"goal >= {least:g}x: {met}")
    if margin_stat is not None and margin_stat.median < EVEN:
        why = next((text for prefix, peer_prefix, text in BEHIND
                    if comparison["id"].startswith(prefix)
                    and peer["key"].startswith(peer_prefix)), "")
        parts.append(f"tierkv behind: {why}" if why else "tierkv behind")
    return "; ".join(parts)


def comparison_rows(comparison: dict[str, Any]) -> list[Row]:
    """One row per peer of one comparison (tierkv's figure in every row)."""
    ours = comparison["tierkv"]
    if ours.get("error") or not ours.get("samples"):
        why = ours.get("error") or "no samples"
        return [Row(PART, comparison["name"], Stat.one(0.0), comparison["unit"],
                    f"tierkv failed: {why}", None, headline=comparison.get("headline", True))]
    value = _stat(ours["samples"])
    rows = []
    for peer in comparison["peers"]:
        label = peer["label"]
        headline = comparison.get("headline", True) and peer.get("headline", True)
        if peer.get("skipped") or peer.get("error"):
            status = (f"skipped: {peer['skipped']}" if peer.get("skipped")
                      else f"failed: {peer['error']}")
            rows.append(Row(PART, comparison["name"], value, comparison["unit"],
                            f"{label} ({status})", None, headline=headline,
                            note=ours.get("note", "")))
            continue
        samples = peer["samples"]
        margin_stat = margin(ours["samples"], samples, comparison["better"],
                             comparison.get("paired", True))
        note = _note(comparison, peer, margin_stat)
        if margin_stat is None:
            note = "; ".join(filter(None, [note, "no ratio: a zero on one side"]))
        paired = (comparison.get("paired", True) and len(samples) == len(ours["samples"]))
        rows.append(Row(PART, comparison["name"], value, comparison["unit"], label,
                        margin_stat, _stat(samples), headline=headline, paired=paired,
                        note=note))
    return rows


def build_rows(record: dict[str, Any]) -> list[Row]:
    """Every comparison of a run's record as rows, in the record's order."""
    rows: list[Row] = []
    for comparison in record["comparisons"]:
        rows += comparison_rows(comparison)
    return rows


def policy_table(record: dict[str, Any]) -> str:
    """The hit ratios of a run as one table: a line per system and policy, a
    column per trace and capacity (for the docs and the part's notes)."""
    cells: dict[str, dict[str, float]] = {}
    columns: list[str] = []
    for comparison in record["comparisons"]:
        if comparison["section"] != "policies" or not comparison.get("column"):
            continue
        column = comparison["column"]
        if column not in columns:
            columns.append(column)
        for result in [comparison["tierkv"], *comparison["peers"]]:
            if result.get("samples"):
                cells.setdefault(result["label"], {})[column] = result["samples"][0]
    if not cells:
        return ""
    width = max(len(label) for label in cells) + 2
    lines = ["".ljust(width) + "".join(c.rjust(20) for c in columns)]
    for label, row in cells.items():
        lines.append(label.ljust(width) + "".join(
            (f"{row[c]:.4f}" if c in row else "-").rjust(20) for c in columns))
    return "\n".join(lines)
