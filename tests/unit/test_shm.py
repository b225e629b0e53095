"""SharedRegion: real POSIX shared memory, shared by real processes."""

from __future__ import annotations

import mmap
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import posix_ipc
import pytest

from tests.mappings import mapped_kib
from tierkv.core import shm
from tierkv.core.shm import (
    ALIGN,
    RegionError,
    RegionInUseError,
    RegionLayout,
    SharedRegion,
    region_name,
    sweep_stale_regions,
)


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, check=False,
    )


def test_layout_rows_are_4k_aligned(instance):
    with SharedRegion.create(instance, num_blocks=3, page_size=1000, world_size=3) as region:
        assert region.layout.row_stride % ALIGN == 0
        assert region.layout.row_stride >= 3000
        assert len(region.row(2)) == region.layout.row_stride
        assert len(region.page(2, rank=2)) == 1000
        assert region.numpy().shape == (3, region.layout.row_stride)
        assert region.numpy_pages(1).shape == (3, 1000)


def test_created_exclusive_and_owner_only(instance):
    with SharedRegion.create(instance, 4, 4096):
        mode = os.stat(f"/dev/shm{region_name(instance)}").st_mode
        assert stat.S_IMODE(mode) == 0o600
        with pytest.raises(RegionInUseError, match="already running"):
            SharedRegion.create(instance, 4, 4096)


def test_views_are_zero_copy(instance):
    with SharedRegion.create(instance, 4, 4096, world_size=2) as region:
        region.page(1, rank=1)[:4] = b"abcd"
        assert bytes(region.numpy_page(1, 1)[:4]) == b"abcd"
        t = region.torch_view()
        t[1, 4096 + 4] = ord("e")
        assert bytes(region.page(1, 1)[:5]) == b"abcde"
        region.numpy_row(3)[:] = 7
        assert region.torch_row(3).sum().item() == 7 * region.layout.row_stride
        region.torch_page(0, 1)[:2] = 9
        assert bytes(region.page(0, 1)[:2]) == b"\x09\x09"
        del t


def test_page_written_by_one_process_is_read_by_another(instance):
    with SharedRegion.create(instance, 8, 64 * 1024, world_size=2) as region:
        writer = run_python(f"""
            import numpy as np
            from tierkv.core.shm import SharedRegion
            r = SharedRegion.attach({instance!r})
            rng = np.random.default_rng(5)
            r.numpy_page(5, 1)[:] = rng.integers(0, 256, r.layout.page_size, dtype=np.uint8)
            r.close()
        """)
        assert writer.returncode == 0, writer.stderr
        expected = np.random.default_rng(5).integers(0, 256, 64 * 1024, dtype=np.uint8)
        assert np.array_equal(region.numpy_page(5, 1), expected)
        # And back: the parent writes, a child checks.
        region.numpy_page(2, 0)[:] = 0xAB
        reader = run_python(f"""
            from tierkv.core.shm import SharedRegion
            r = SharedRegion.attach({instance!r})
            ok = bool((r.numpy_page(2, 0) == 0xAB).all())
            r.close()
            raise SystemExit(0 if ok else 3)
        """)
        assert reader.returncode == 0, reader.stderr


@pytest.mark.parametrize(
    "field, expect",
    [("num_blocks", RegionLayout(5, 4096)), ("page_size", RegionLayout(4, 8192)),
     ("world_size", RegionLayout(4, 4096, 2))],
)
def test_attach_names_the_mismatched_field(instance, field, expect):
    with SharedRegion.create(instance, 4, 4096):
        with pytest.raises(RegionError, match=f"field {field} is"):
            SharedRegion.attach(instance, expect=expect)


def test_attach_rejects_foreign_segment(instance):
    shm = posix_ipc.SharedMemory(region_name(instance), posix_ipc.O_CREX, size=8192)
    shm.close_fd()
    try:
        with pytest.raises(RegionError, match="magic"):
            SharedRegion.attach(instance)
    finally:
        posix_ipc.unlink_shared_memory(region_name(instance))


def test_attach_missing_says_broker_not_running(instance):
    with pytest.raises(RegionError, match="does not exist"):
        SharedRegion.attach(instance)


def test_stale_region_of_dead_owner_is_replaced(instance):
    # A child creates the region and dies without unlinking (SIGKILL-like exit).
    child = run_python(f"""
        import os
        from tierkv.core.shm import SharedRegion
        SharedRegion.create({instance!r}, 4, 4096)
        os._exit(0)
    """)
    assert child.returncode == 0, child.stderr
    assert os.path.exists(f"/dev/shm{region_name(instance)}")
    with SharedRegion.create(instance, 2, 8192) as region:
        assert region.layout.num_blocks == 2
        assert region.layout.page_size == 8192


def test_a_live_owner_is_refused_as_in_use_even_when_the_size_does_not_fit(instance):
    # The live owner's region holds the name: that is the reason to give, not the
    # free space a second creator of the same instance asks for.
    with SharedRegion.create(instance, 1, 4096):
        with pytest.raises(RegionInUseError, match="already running"):
            SharedRegion.create(instance, 1 << 40, 1 << 20)
        assert os.path.exists(f"/dev/shm{region_name(instance)}")


def test_sweep_removes_only_dead_owners(instance):
    live = SharedRegion.create(instance + "live", 1, 4096)
    try:
        child = run_python(f"""
            import os
            from tierkv.core.shm import SharedRegion
            SharedRegion.create({instance + 'dead'!r}, 1, 4096)
            os._exit(0)
        """)
        assert child.returncode == 0, child.stderr
        removed = sweep_stale_regions()
        assert f"tierkv.{instance}dead.cpu" in removed
        assert os.path.exists(f"/dev/shm{live.name}")
    finally:
        live.close()
        live.unlink()


def test_close_and_unlink_are_idempotent(instance):
    region = SharedRegion.create(instance, 1, 4096)
    region.close()
    region.close()
    region.unlink()
    region.unlink()
    assert not os.path.exists(f"/dev/shm{region.name}")
    with pytest.raises(RegionError, match="closed"):
        region.row(0)


def test_only_creator_unlinks(instance):
    with SharedRegion.create(instance, 1, 4096):
        attached = SharedRegion.attach(instance)
        with pytest.raises(RegionError, match="only the creator"):
            attached.unlink()
        attached.close()


def test_close_with_live_view_does_not_raise(instance):
    region = SharedRegion.create(instance, 1, 4096)
    view = region.numpy()
    region.close()
    region.unlink()
    assert view.shape[0] == 1
    del view


@pytest.mark.parametrize("bad", [dict(num_blocks=0), dict(page_size=-1), dict(world_size=0)])
def test_bad_layout_is_refused(instance, bad):
    args = dict(num_blocks=1, page_size=4096, world_size=1) | bad
    with pytest.raises(RegionError, match=next(iter(bad))):
        SharedRegion.create(instance, **args)


def test_too_large_for_dev_shm(instance):
    # 2**40 rows of 1 MiB, and the free space in the unit that shows it.
    with pytest.raises(RegionError, match=r"region of 1073741824\.0 GiB does not fit: "
                       r"/dev/shm has [0-9.]+ ([KMG]iB|bytes) free"):
        SharedRegion.create(instance, 1 << 40, 1 << 20)
    assert not os.path.exists(f"/dev/shm{region_name(instance)}")


def test_bad_instance_name():
    with pytest.raises(RegionError, match="may not contain"):
        SharedRegion.create("a/b", 1, 4096)


def test_prefault_allocates_without_changing_contents(instance):
    with SharedRegion.create(instance, 64, 64 * 1024, prefault=True) as region:
        assert not region.numpy().any()  # still zero
        used = os.stat(f"/dev/shm{region.name}").st_blocks * 512
        assert used >= region.layout.total_size - 4096  # the pages exist now


def test_without_populate_write_every_page_is_allocated_and_kept(instance, monkeypatch):
    # A kernel before 5.14 refuses the advice: each page is written back as it is
    # (a page written before keeps its bytes), the first included (a KV cache's
    # segment has no header there).
    monkeypatch.setattr(shm, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel takes
    name = f"/tierkv.{instance}.fallback"
    size = 64 * ALIGN
    segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        mm = mmap.mmap(segment.fd, size)
        at = 3 * ALIGN
        mm[at:at + 5] = b"kept!"
        shm.allocate_pages(mm)
        assert os.stat(f"/dev/shm{name}").st_blocks * 512 >= size
        assert mm[at:at + 5] == b"kept!" and mm[:at] == bytes(at) and not any(mm[at + 5:])
        mm.close()
    finally:
        segment.close_fd()
        segment.unlink()


def test_a_process_that_copies_through_the_region_maps_it_whole_at_attach(instance):
    # A worker attaching a prefaulted region has every page mapped before its first
    # copy (no page fault per 4 KiB page in the copy); another attach maps only what
    # it touches.
    with SharedRegion.create(instance, 64, 64 * 1024, prefault=True) as region:
        with SharedRegion.attach(instance, populate=True) as copier:
            assert mapped_kib(copier.numpy()) * 1024 >= region.layout.total_size - 4096
            assert not copier.numpy().any()  # contents unchanged
        with SharedRegion.attach(instance) as reader:
            assert mapped_kib(reader.numpy()) * 1024 < region.layout.total_size // 2


def test_populate_allocates_nothing_the_broker_did_not(instance):
    with SharedRegion.create(instance, 64, 64 * 1024, prefault=False) as region:
        with SharedRegion.attach(instance, populate=True) as copier:
            used = os.stat(f"/dev/shm{region.name}").st_blocks * 512
            assert used < region.layout.total_size // 2
            assert mapped_kib(copier.numpy()) * 1024 < region.layout.total_size // 2
