"""KV layouts, and KV caches in shared memory opened by another real process."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest
import torch

from tests.mappings import mapped_kib
from tierkv.engine import (
    KVCache,
    KVCacheError,
    KVLayout,
    KVLayoutError,
    OpenedKV,
    allocate_kv_cache,
    block_views,
    open_kv_cache,
    sweep_stale_kv_segments,
)


def small_per_layer(num_blocks: int = 6, dtype: str = "float16") -> KVLayout:
    return KVLayout.per_layer(3, num_blocks, 4, 2, 8, dtype)


def shm_entries(instance: str) -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"tierkv.{instance}."))


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )


# -- layouts --------------------------------------------------------------------------------


def test_per_layer_page_math():
    layout = KVLayout.per_layer(32, 100, 16, 8, 128, "float16")
    assert layout.block_dim == 1
    assert layout.tensor_shapes == ((2, 100, 16, 8, 128),) * 32
    piece = 16 * 8 * 128 * 2  # one block of K (or V) of one layer, bytes
    assert layout.geometry(0) == (2, piece)
    assert layout.page_size == 32 * 2 * piece == 2 << 20
    assert layout.page_offsets[:3] == [0, 2 * piece, 4 * piece]
    assert layout.tensor_bytes(0) == 2 * 100 * piece


def test_blocks_outer_page_math():
    layout = KVLayout.blocks_outer(100, 32, 16, 8, 128, "bfloat16")
    assert layout.block_dim == 0
    assert layout.tensor_shapes == ((100, 32, 2, 16, 8, 128),)
    assert layout.geometry(0) == (1, 2 << 20)
    assert layout.page_size == 2 << 20
    assert layout.page_offsets == [0]


@pytest.mark.parametrize(("dtype", "size"), [("float32", 4), ("uint8", 1), ("bfloat16", 2)])
def test_itemsize_follows_dtype(dtype, size):
    assert small_per_layer(dtype=dtype).page_size == 3 * 2 * 4 * 2 * 8 * size


def test_mixed_shapes_and_inner_block_dim():
    layout = KVLayout(5, 4, "float16", ((2, 5, 3), (4, 5, 1, 2)), 1)
    assert layout.geometry(0) == (2, 6)
    assert layout.geometry(1) == (4, 4)
    assert layout.page_size == 12 + 16
    assert layout.page_offsets == [0, 12]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_shapes": ((2, 7, 4),)}, "7 blocks on dimension 1, expected num_blocks=6"),
        ({"dtype": "float13"}, "dtype 'float13' is not supported"),
        ({"tensor_shapes": ()}, "tensor_shapes is empty"),
        ({"block_dim": 3}, "block_dim 3 is out of range"),
        ({"num_blocks": 0}, "num_blocks must be a positive integer"),
        ({"num_blocks": True}, "num_blocks must be a positive integer"),
        ({"tensor_shapes": ((2, 6, 0),)}, r"tensor_shapes\[0\] dimension must be a positive"),
        ({"tensor_shapes": "abc"}, "tensor_shapes must be a list"),
        ({"block_dim": -1}, "block_dim must be a non-negative integer"),
    ],
)
def test_layout_validation(kwargs, match):
    args = {"num_blocks": 6, "block_size_tokens": 4, "dtype": "float16",
            "tensor_shapes": ((2, 6, 4),), "block_dim": 1}
    args.update(kwargs)
    with pytest.raises(KVLayoutError, match=match):
        KVLayout(**args)


def test_layout_dict_roundtrip_through_msgpack():
    layout = small_per_layer()
    wire = msgpack.unpackb(msgpack.packb(layout.to_dict(), use_bin_type=True), raw=False)
    assert KVLayout.from_dict(wire) == layout
    with pytest.raises(KVLayoutError, match="missing"):
        KVLayout.from_dict({"num_blocks": 3})
    with pytest.raises(KVLayoutError, match="must be a map"):
        KVLayout.from_dict([1, 2])


# -- allocation and registration ------------------------------------------------------------


def test_allocate_names_mode_and_close_unlinks(instance):
    layout = small_per_layer()
    kv = allocate_kv_cache(instance, 3, layout)
    (entry,) = shm_entries(instance)
    assert entry.startswith(f"tierkv.{instance}.kv3.{os.getpid()}.")
    assert stat.S_IMODE(os.stat(f"/dev/shm/{entry}").st_mode) == 0o600
    assert [tuple(t.shape) for t in kv.tensors] == list(layout.tensor_shapes)
    assert all(t.dtype == torch.float16 and t.is_contiguous() for t in kv.tensors)
    kv.close()
    kv.close()
    assert shm_entries(instance) == []
    with pytest.raises(KVCacheError, match="closed"):
        kv.registration()


def test_registration_is_plain_msgpack(instance):
    with allocate_kv_cache(instance, 0, small_per_layer()) as kv:
        reg = kv.registration()
        wire = msgpack.unpackb(
            msgpack.packb(reg, use_bin_type=True), raw=False, strict_map_key=True
        )
        assert wire == reg
        assert reg["device"] == "cpu"
        assert len(reg["tensors"]) == 3
        assert all(t["offset"] % 4096 == 0 for t in reg["tensors"])
        with open_kv_cache(wire) as opened:
            assert opened.layout == kv.layout
            kv.tensors[1][0, 2].fill_(3.5)
            assert opened.tensors[1][0, 2].eq(3.5).all()


def test_the_worker_copies_through_pages_the_engine_allocated_and_it_mapped(instance):
    # The segment is allocated whole when the engine makes it, and the worker maps
    # every page when it opens it: neither side's first copy of a block faults its
    # pages in one by one.
    layout = KVLayout.per_layer(2, 64, 16, 2, 64, "float16")
    with allocate_kv_cache(instance, 0, layout) as kv:
        size = kv.registration()["segments"][0]["size"]
        name = kv.registration()["segments"][0]["name"]
        assert os.stat(f"/dev/shm{name}").st_blocks * 512 >= size
        assert not kv.tensors[1].any()
        with open_kv_cache(kv.registration()) as opened:
            assert mapped_kib(opened.byte_block_views()[0]) * 1024 >= size


CHILD_OPEN = """
import json, sys, msgpack, torch
from tierkv.engine import open_kv_cache
out = []
for path in sys.argv[1:]:
    kv = open_kv_cache(msgpack.unpackb(open(path, "rb").read(), raw=False))
    out.append([int(t.view(torch.int16).to(torch.int64).sum()) for t in kv.tensors])
    kv.tensors[0][1].fill_(-2.0)  # the engine sees what the worker writes
    kv.close()
print(json.dumps(out))
"""


def test_child_process_sees_the_same_bytes(instance, tmp_path):
    """One child (importing torch is slow) opens a cache of each layout."""
    layouts = [small_per_layer(), KVLayout.blocks_outer(6, 3, 4, 2, 8, "bfloat16")]
    caches = [allocate_kv_cache(instance, r, lay) for r, lay in enumerate(layouts)]
    try:
        want, paths = [], []
        for r, kv in enumerate(caches):
            for t in kv.tensors:
                t.view(torch.int16).random_(-(2**15), 2**15)
            want.append([int(t.view(torch.int16).to(torch.int64).sum()) for t in kv.tensors])
            paths.append(tmp_path / f"reg{r}.msgpack")
            paths[-1].write_bytes(msgpack.packb(kv.registration(), use_bin_type=True))
        proc = run_python(CHILD_OPEN, *map(str, paths))
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == want
        assert all(kv.tensors[0][1].eq(-2.0).all() for kv in caches)
    finally:
        for kv in caches:
            kv.close()
    assert shm_entries(instance) == []


def test_reregistration_after_engine_restart(instance):
    layout = small_per_layer()
    old = allocate_kv_cache(instance, 0, layout)
    opened = open_kv_cache(old.registration())
    old.close()  # the engine went away; the worker's mapping stays valid
    new = allocate_kv_cache(instance, 0, layout)
    new.tensors[0].fill_(1.0)
    opened.close()
    opened = open_kv_cache(new.registration())
    assert opened.tensors[0].eq(1.0).all()
    opened.close()
    new.close()
    assert shm_entries(instance) == []


def test_from_tensors_of_an_allocated_cache(instance):
    layout = small_per_layer()
    with allocate_kv_cache(instance, 0, layout) as kv:
        again = KVCache.from_tensors(list(reversed(kv.tensors))[::-1], layout)
        reg = again.registration()
        assert reg["segments"] == kv.registration()["segments"]
        again.close()  # not the owner: the segment stays
        assert len(shm_entries(instance)) == 1
        with open_kv_cache(reg) as opened:
            kv.tensors[2].fill_(7.0)
            assert opened.tensors[2].eq(7.0).all()


def test_from_tensors_refuses_plain_cpu_tensors():
    layout = small_per_layer()
    tensors = [torch.zeros(s, dtype=torch.float16) for s in layout.tensor_shapes]
    with pytest.raises(KVCacheError, match="not in tierkv shared memory"):
        KVCache.from_tensors(tensors, layout)


def test_from_tensors_checks_shapes_and_dtype():
    layout = small_per_layer()
    good = [torch.zeros(s, dtype=torch.float16) for s in layout.tensor_shapes]
    with pytest.raises(KVCacheError, match="has dtype torch.float32"):
        KVCache.from_tensors([good[0].float(), *good[1:]], layout)
    with pytest.raises(KVCacheError, match="2 tensors given"):
        KVCache.from_tensors(good[:2], layout)
    with pytest.raises(KVCacheError, match="has shape"):
        KVCache.from_tensors([good[0][:, :3], *good[1:]], layout)
    # the block's trailing dimensions must be contiguous to be copied as bytes
    strided = torch.zeros(8, 6, 4, 2, 2, dtype=torch.float16).permute(4, 1, 2, 3, 0)
    bad_layout = KVLayout(6, 4, "float16", (tuple(strided.shape),), 1)
    with pytest.raises(KVCacheError, match="cannot be seen as"):
        OpenedKV.local([strided], bad_layout)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda r: r.update(version=9), "registration version 9"),
        (lambda r: r.update(device="tpu"), "must be 'cpu' or 'cuda'"),
        (lambda r: r["tensors"][0].update(shape=[1, 2]), r"tensors\[0\] shape"),
        (lambda r: r["tensors"][1].update(dtype="float32"), r"tensors\[1\] dtype"),
        (lambda r: r["tensors"][0].update(offset=1 << 40), "past the"),
        (lambda r: r["tensors"].pop(), "must list 3 tensors"),
        (lambda r: r["segments"][0].update(name="/etc.passwd"), "not a tierkv KV segment"),
        (lambda r: r["segments"][0].update(size=1 << 40), "registration says"),
        (lambda r: r["layout"].update(dtype="complex"), "registration layout"),
        (lambda r: r.update(storages=[{}], device="cuda"), "CUDA"),
        # In bounds, but the bytes of a block are not one stretch per piece:
        (lambda r: r["tensors"][0].update(stride=[384, 64, 16, 1, 8]),
         "last dimension must be contiguous"),
        (lambda r: r["tensors"][0].update(stride=[384, 64, 8, 32, 1]), "cannot be seen as"),
    ],
)
def test_open_validates_the_registration(instance, mutate, match):
    with allocate_kv_cache(instance, 0, small_per_layer()) as kv:
        reg = msgpack.unpackb(msgpack.packb(kv.registration(), use_bin_type=True), raw=False)
        mutate(reg)
        with pytest.raises(KVCacheError, match=match):
            open_kv_cache(reg)


@pytest.mark.parametrize("layout", [
    small_per_layer(),
    KVLayout.blocks_outer(6, 3, 4, 2, 8, "bfloat16"),
    KVLayout(5, 4, "float32", ((2, 5, 3), (4, 5, 1, 2)), 1),
], ids=["per_layer", "blocks_outer", "mixed"])
def test_a_cpu_cache_opens_as_the_bytes_of_its_blocks(instance, layout):
    """What a CPU worker copies (numpy, no torch): each block's bytes, shared with
    the engine both ways."""
    with allocate_kv_cache(instance, 0, layout) as kv, \
            open_kv_cache(kv.registration()) as opened:
        for t in kv.tensors:
            t.view(torch.uint8).random_(0, 256)
        got = opened.byte_block_views()
        want = [v.numpy() for v in block_views(kv.tensors, layout)]
        assert opened.kind == "cpu" and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and np.array_equal(g, w)
        got[-1][:, 2, :] = 7  # the worker's write of block 2 is the engine's
        assert block_views(kv.tensors, layout)[-1][:, 2].eq(7).all()
        assert opened.tensors[0].dtype == kv.tensors[0].dtype  # torch, when asked for
        assert torch.equal(opened.tensors[0].view(torch.uint8), kv.tensors[0].view(torch.uint8))


def test_open_a_vanished_segment_fails_clearly(instance):
    kv = allocate_kv_cache(instance, 0, small_per_layer())
    reg = kv.registration()
    kv.close()
    with pytest.raises(KVCacheError, match="does not exist"):
        open_kv_cache(reg)


def test_close_with_live_views_does_not_raise(instance, caplog):
    with allocate_kv_cache(instance, 0, small_per_layer()) as kv:
        opened = open_kv_cache(kv.registration())
        view = opened.tensors[0]
        opened.close()
        assert "views still alive" in caplog.text
        del view


def test_sweep_removes_a_crashed_engines_segment(instance):
    # A dead engine's segment, named as allocate_kv_cache names it (no torch: fast).
    crash = f"""
        import os, posix_ipc
        from tierkv.engine import kv_segment_name
        name = kv_segment_name({instance!r}, 0, os.getpid(), 0)
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    """
    assert run_python(crash).returncode == 0
    assert len(shm_entries(instance)) == 1
    with allocate_kv_cache(instance, 1, small_per_layer()):
        removed = sweep_stale_kv_segments(instance)
        assert len(removed) == 1 and ".kv0." in removed[0]
        assert len(shm_entries(instance)) == 1  # ours, alive, is kept
    assert shm_entries(instance) == []


def test_allocate_refuses_bad_names():
    with pytest.raises(KVCacheError, match="instance name"):
        allocate_kv_cache("a/b", 0, small_per_layer())
    with pytest.raises(KVCacheError, match="rank"):
        allocate_kv_cache("tok", -1, small_per_layer())


# -- CUDA IPC bookkeeping: the exporter's counters, and allocators that cannot export --------


@pytest.fixture
def torch_counter_file():
    """A shared-memory file made by torch's own RefcountedMapAllocator, the allocator
    of torch's CUDA IPC counter files: 16 int64 counters, counter 3 set to 1."""
    storage = torch.UntypedStorage._new_using_filename_cpu(8 * 16)
    handle = storage._share_filename_cpu_()[1]
    counters = torch.empty(0, dtype=torch.uint8).set_(storage).view(torch.int64)
    counters[3] = 1  # what _share_cuda_ sets for one export
    yield {"ref_counter": handle, "ref_counter_offset": 3}, counters
    del counters, storage


def test_counter_layout_is_torchs_and_each_holder_balances(torch_counter_file):
    from tierkv.engine.ipc import drop_reference, read_counter, take_reference

    entry, counters = torch_counter_file
    take_reference(entry)  # a worker opens the registration
    assert int(counters[3]) == 2 and read_counter(entry["ref_counter"], 3) == 2
    drop_reference(entry)  # its storage is freed (torch's deleter)
    take_reference(entry)  # a restarted worker opens the same registration again
    drop_reference(entry)
    assert int(counters[3]) == 1  # the export's own reference is still there
    drop_reference(entry)  # the engine closes its KVCache
    assert int(counters[3]) == 0 and int(counters[2]) == int(counters[4]) == 0


def test_counter_refuses_what_is_not_a_counter(torch_counter_file):
    from tierkv.engine.ipc import adjust_counter, drop_reference, take_reference

    entry, counters = torch_counter_file
    with pytest.raises(KVCacheError, match="outside"):
        adjust_counter(entry["ref_counter"], 16, 1)
    counters[5] = -7
    with pytest.raises(KVCacheError, match="not a reference count"):
        adjust_counter(entry["ref_counter"], 5, 1)
    with pytest.raises(KVCacheError, match="not a reference count"):
        adjust_counter(entry["ref_counter"], 6, -1)  # 0 cannot go below 0
    gone = {"ref_counter": b"/torch_0_0_gone", "ref_counter_offset": 0}
    with pytest.raises(KVCacheError, match="is gone"):
        take_reference(gone)
    drop_reference(gone)  # the engine exited: nothing to give back, no error


@pytest.mark.parametrize("settings,error,handle,names", [
    ("PYTORCH_CUDA_ALLOC_CONF='backend:cudaMallocAsync'", "not supported", b"",
     "backend:cudaMallocAsync"),
    ("PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'", "invalid argument", b"",
     "expandable_segments:True"),
    ("default allocator settings", "cuMemImportFromShareableHandle failed", b"\x02e",
     "expandable_segments:True"),
    ("allocator backend native", "CUDAPluggableAllocator does not yet support shareIpcHandle",
     b"", "enable_sleep_mode=True"),
    ("allocator backend native", "invalid device pointer", b"", "native caching allocator"),
])
def test_export_failures_name_the_allocator_setting(settings, error, handle, names):
    from tierkv.engine.ipc import export_failure

    message = export_failure(RuntimeError(error), settings, handle)
    assert names in message and error in message and settings in message
