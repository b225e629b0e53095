"""The stream and event calls of the CUDA copy path, behind one small seam.

Why a seam: the order of stream calls is the copy path's correctness (a copy that
does not wait for the model reads half-written KV), and it cannot be seen on a
machine without a GPU. `copy_cuda` makes every stream, event and device call
through a `StreamOps`; `TorchStreams` makes them with torch. The CPU tests pass an
implementation that records the calls and runs the copies on the host, so they
check which stream waits for what, in which order, without a device and without
patching torch.

Every method is called on the thread that submits jobs (the gpu worker's main
thread, or the engine thread that calls `submit` inside vLLM), except `bind`,
which each completion thread calls once, and the events' ``synchronize``, which
the completion threads block on. None of them blocks but ``synchronize``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class StreamOps(Protocol):
    """What the CUDA copy path asks of the device. Streams and events are opaque
    to it; an event must have ``synchronize()`` (it is a job's `EndMarker`)."""

    def available(self) -> bool:
        """Whether this process can use a CUDA device at all."""

    def current_device(self) -> torch.device:
        """The calling thread's current device (the default when none is named)."""

    def bind(self, device: torch.device) -> None:
        """Make `device` current on the calling thread (a completion thread)."""

    def on_device(self, device: torch.device) -> AbstractContextManager[Any]:
        """Run the calls inside on `device`, so no context is made on another GPU."""

    def new_stream(self, device: torch.device) -> Any:
        """A stream of the copy path's own."""

    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on `device`: where the caller (the
        model, inside the engine's process) queued its writes to the KV cache."""

    def new_event(self, *, timing: bool = False, blocking: bool = False) -> Any:
        """An event; `blocking`: a thread that synchronizes on it sleeps."""

    def record(self, event: Any, stream: Any) -> None:
        """Mark the point of `stream` reached by the work queued on it so far."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on `stream` from now on starts after `event`'s last record."""

    def issue_on(self, stream: Any) -> AbstractContextManager[Any]:
        """Queue the torch ops inside (gathers, scatters, copies) on `stream`."""

    def handle(self, stream: Any) -> int:
        """The raw stream handle, for the runtime's DMA calls."""

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of host `tensor`, so an asynchronous copy of it does
        not wait for earlier work."""

    def seconds(self, start: Any, end: Any) -> float:
        """Device seconds between two completed timing events."""


class HostFence(Protocol):
    """The CPU copy path's analogue of a recorded CUDA event: a point the engine's
    host-side compute reaches (a CPU model's forward pass that writes the KV cache on
    a thread of its own has finished). `threading.Event` is one."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the point is reached (True) or `timeout` passed (False)."""


#: The CPU copy path's analogue of ``record(event, current_stream())``: called on the
#: thread that submits a job, as it submits it; returns the fence after which every
#: write to the KV cache launched so far is done (None: nothing is pending, as in
#: vLLM's CPU model runner, which computes on the submitting thread). The copy
#: thread waits for it before it reads or writes the job's KV blocks.
HostOrder = Callable[[], HostFence | None]


class TorchStreams:
    """`StreamOps` made with torch's CUDA API (the production implementation)."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def bind(self, device: torch.device) -> None:
        if device.index is not None:
            torch.cuda.set_device(device.index)

    def on_device(self, device: torch.device) -> AbstractContextManager[Any]:
        return torch.cuda.device(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_event(self, *, timing: bool = False, blocking: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing, blocking=blocking)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def issue_on(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1000.0
