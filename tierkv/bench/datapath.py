"""`tierkv bench datapath`: block bytes moved by the worker against a plain copy.

Two views of the same path, each against one plain copy of the same total bytes
timed back to back with it in every repeat:

- the copy engine alone (`tierkv/bench/copy_engine.py`): a job of N blocks between
  the engine's KV cache and the CPU tier, against one single-threaded
  `np.copyto` (CPU) or one pinned `cudaMemcpyAsync` (CUDA, when present);
- through the service (`tierkv/bench/broker_ops.py`'s `data_path`): `store` then
  `load` by a client, broker and CPU worker, until the broker answers that the job
  finished (`Client.wait`: no polling), against the same bytes copied in the
  pieces of the KV layout (a chunked memcpy: the most a copy engine can do for this
  layout) and against one `np.copyto`. This adds the control plane's latency to
  every job.
"""

from __future__ import annotations

from typing import Any

from tierkv.bench.common import Options, Part, Row, Stat, rates, ratio

PATTERNS = ["consecutive", "scattered"]


def _engine_rows(part: Part, rows: list[Any], reference: str, headline: bool) -> None:
    for r in rows:
        part.add(Row(
            "datapath", f"{r.backend} engine {r.direction}, {r.page_kib} KiB pages, {r.pattern}",
            Stat.of(rates(r.nbytes / 1e9, r.engine_s)), "GB/s", reference,
            ratio(r.ref_s, r.engine_s), Stat.of(rates(r.nbytes / 1e9, r.ref_s)),
            headline=headline, note=f"{r.nbytes / r.page_kib / 1024:.0f} blocks per job"))


def run(part: Part, opts: Options) -> None:
    import torch

    from tierkv.bench import broker_ops, copy_engine

    # As bench_transfer's main does: torch's own copies on one thread, against a
    # single-threaded reference copy.
    torch.set_num_threads(1)
    repeats = opts.pick(2, 5)
    # (page bytes, blocks per job): 256 KiB is a typical block of a 8B model; 2 MiB
    # pages with fewer blocks keep the buffers at 256 MiB.
    sizes = [(64 << 10, 64)] if opts.quick else [(256 << 10, 1000), (2 << 20, 128)]
    for i, (page, blocks) in enumerate(sizes):
        if part.over_budget(f"copy engine, {page >> 10} KiB pages"):
            return
        rows = copy_engine.bench_cpu("per_layer", page, blocks, PATTERNS, repeats)
        _engine_rows(part, rows, "np.copyto", headline=i == 0)
    if torch.cuda.is_available():
        part.note(f"CUDA: {torch.cuda.get_device_name()}")
        for i, (page, blocks) in enumerate(sizes):
            if part.over_budget(f"CUDA engine, {page >> 10} KiB pages"):
                return
            rows = copy_engine.bench_cuda("per_layer", page, blocks, PATTERNS, repeats)
            _engine_rows(part, rows, "pinned cudaMemcpyAsync", headline=i == 0)
    else:
        part.note("no CUDA on this machine: the CUDA copy engine is not measured")

    page, blocks = sizes[0]
    if part.over_budget("store/load through broker + worker"):
        return
    with broker_ops.bench_node(blocks, page) as (client, kv):
        dp = broker_ops.data_path(client, kv, blocks, page, repeats)
    gb = dp["bytes"] / 1e9
    piece = f"chunked memcpy ({dp['piece'] >> 10} KiB pieces)"
    for direction in ("store", "load"):
        label = f"{direction} via broker + CPU worker, {page >> 10} KiB x {blocks}"
        for reference, times, headline in ((piece, dp["chunked"], True),
                                           ("np.copyto", dp["memcpy"], False)):
            part.add(Row(
                "datapath", label, Stat.of(rates(gb, dp[direction])), "GB/s", reference,
                ratio(times, dp[direction]), Stat.of(rates(gb, times)), headline=headline,
                note="client call until the broker says the job finished"))
