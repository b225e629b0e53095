"""Copies ordered after the model on a real GPU: a store submitted while a chain of
in-place ops on the current stream still writes the blocks stores their final
bytes, and a load submitted behind a queued zeroing of its blocks keeps its bytes
(`workers.gpu.check.ordering`, also a part of scripts/gpu-check). Skipped without
CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from workers.gpu.check import ordering  # noqa: E402


def test_copies_wait_for_the_work_queued_on_the_callers_stream():
    assert ordering.races() == {"store": 0, "load": 0}
