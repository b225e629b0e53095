"""SGLang's own `HiCacheController`, its storage threads running, with tierkv as its
L3: the backup thread stores host pages (`batch_set_v1`, or `batch_set` without
`interface_v1`), the prefetch thread asks for them (`batch_exists`) and the prefetch
I/O thread reads them into other host pages (`batch_get_v1`), byte for byte.

Here the test plays the scheduler's part between the threads, as SGLang's radix
cache does: it takes the hit from `prefetch_hit_queue`, allocates host pages for it
and hands the operation to `prefetch_buffer`. No device <-> host copy runs (the
controller's CUDA streams); the device pool is SGLang's, on the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.sglang.pools import (
    PAGE_TOKENS,
    TOKENS,
    PoolShape,
    bytes_at,
    device_pool,
    extra_config,
    fill_at,
    host_pool,
    node_page,
)
from tierkv.core.shm import SharedRegion

PAGES = 6
# Only a guard against a hung thread: every wait below normally ends in milliseconds.
QUEUE_WAIT_S = 60.0


@dataclass
class Engine:
    controller: Any
    host: Any
    node: Any


@pytest.fixture
def parallel() -> Iterator[None]:
    """One rank of one: what SGLang's scheduler publishes before it builds its cache."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    yield
    get_parallel().clear_stamp()


@pytest.fixture
def engine(start_node, parallel, request) -> Iterator[Engine]:
    """A real HiCacheController over CPU pools, attached to a node through SGLang's
    dynamic factory (`--hicache-storage-backend dynamic`)."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    shape, v1 = request.param
    device = device_pool(shape.kind)
    host = host_pool(shape, device)
    node = start_node(node_page(host))
    extra = extra_config(node)
    if not v1:
        extra.pop("interface_v1")
    allocator = PagedTokenToKVPoolAllocator(TOKENS, PAGE_TOKENS, torch.bfloat16, "cpu",
                                            device, need_sort=False)
    controller = HiCacheController(
        allocator, host, PAGE_TOKENS, tp_group=None, load_cache_event=threading.Event(),
        storage_backend="dynamic", prefetch_threshold=PAGE_TOKENS,
        model_name="tiny/test-model", storage_backend_extra_config=extra,
        enable_storage_metrics=True)
    try:
        assert type(controller.storage_backend).__name__ == "TierkvStorage"
        yield Engine(controller, host, node)
    finally:
        controller.detach_storage_backend()  # stops its threads, closes the backend


CASES = [(PoolShape("mha", "page_first"), True), (PoolShape("mla", "layer_first"), True),
         (PoolShape("mha", "layer_first"), False)]


def case_id(case: tuple[PoolShape, bool]) -> str:
    return f"{case[0]}-{'v1' if case[1] else 'flat'}"


def tokens(first: int, pages: int) -> list[int]:
    return list(range(first, first + pages * PAGE_TOKENS))


def backup(engine: Engine, token_ids: list[int], seed: int) -> tuple[list[str], list[bytes]]:
    """Fill host pages, have the backup thread store them; their keys and bytes."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    ctl = engine.controller
    keys = get_storage_hash_str(token_ids, None, page_size=PAGE_TOKENS)
    source = engine.host.alloc(len(token_ids))
    written = fill_at(engine.host, source, seed)
    op_id = ctl.write_storage(source, token_ids, hash_value=keys)
    done = ctl.ack_backup_queue.get(timeout=QUEUE_WAIT_S)
    assert done.id == op_id
    assert done.completed_tokens == len(token_ids)
    return keys, written


def hit_query(engine: Engine, request_id: str, token_ids: list[int]) -> Any:
    """The prefetch thread's answer for a request's tokens (SGLang hashes them)."""
    ctl = engine.controller
    operation = ctl.prefetch(request_id, token_ids)
    hit = ctl.prefetch_hit_queue.get(timeout=QUEUE_WAIT_S)
    assert hit is operation
    return operation


def host_pages_for(engine: Engine, operation: Any) -> torch.Tensor:
    """The scheduler's part: host pages for the hit."""
    target = engine.controller.alloc_prefetch_host_buffers(operation,
                                                           operation.storage_hit_count)
    assert target is not None
    return target


def transfer(engine: Engine, operation: Any, target: torch.Tensor) -> int:
    """The I/O thread's part: the hit read into `target`; the tokens the controller
    says arrived."""
    ctl = engine.controller
    operation.host_indices = target
    ctl.prefetch_buffer.put(operation)
    completed = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=QUEUE_WAIT_S)
        assert ack.operation is operation
        if ack.completed_tokens is not None:
            completed = ack.completed_tokens
        if ack.completed_req:
            return completed


@pytest.mark.parametrize("engine", CASES, ids=case_id, indirect=True)
def test_backup_then_prefetch_through_the_controllers_threads(engine):
    stored = tokens(1000, PAGES)
    keys, written = backup(engine, stored, seed=11)
    # A request that shares the stored prefix and goes on past it.
    operation = hit_query(engine, "req-1", stored + tokens(5000, 2))
    assert operation.storage_hit_count == PAGES * PAGE_TOKENS
    assert operation.hash_value == keys
    target = host_pages_for(engine, operation)
    assert transfer(engine, operation, target) == PAGES * PAGE_TOKENS
    assert bytes_at(engine.host, target) == written
    # Nothing is left pinned at the node once the read is done.
    assert engine.controller.storage_backend.link._held == {}


@pytest.mark.parametrize("engine", CASES[:1], ids=case_id, indirect=True)
def test_a_request_with_nothing_stored_is_no_hit(engine):
    backup(engine, tokens(1000, 2), seed=12)
    operation = hit_query(engine, "req-2", tokens(7000, 3))
    assert operation.storage_hit_count == 0
    assert operation.hash_value == []
    assert engine.controller.storage_backend.link._held == {}


@pytest.mark.parametrize("engine", CASES[:1], ids=case_id, indirect=True)
def test_a_page_corrupted_after_the_hit_query_ends_the_prefetch_there(engine, instance):
    stored = tokens(1000, PAGES)
    keys, written = backup(engine, stored, seed=13)
    operation = hit_query(engine, "req-3", stored)
    assert operation.storage_hit_count == PAGES * PAGE_TOKENS
    storage = engine.controller.storage_backend
    with SharedRegion.attach(instance) as region:
        rows = region.numpy()
        rows[storage.link._held[storage._keys([keys[3]])[0]].row, 5] ^= 0xFF
        del rows
    target = host_pages_for(engine, operation)
    before = fill_at(engine.host, target, seed=14)  # to show no wrong byte lands
    assert transfer(engine, operation, target) == 3 * PAGE_TOKENS
    landed = bytes_at(engine.host, target)
    assert landed[:3] == written[:3]
    assert landed[3:] == before[3:]
    assert storage.counters()["pages_failed_check"] == 1

