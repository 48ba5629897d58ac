"""Wall-clock timing around asynchronous GPU work.

CUDA kernels and copies return before they finish, so a wall-clock time of GPU work is taken
between two device synchronisations. Without CUDA (the CPU build, CI) every call is synchronous
and ``synchronize`` does nothing.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def synchronize(device: torch.device) -> None:
    """Wait until all work queued on ``device`` has finished (nothing to wait for without CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronized_seconds(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """``(fn(), seconds)``: the wall time of ``fn`` from a synchronised start until the work it
    queued on ``device`` has finished."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def stamp(device: torch.device):
    """A point on ``device``'s current stream: a recorded timing event on CUDA (no synchronisation),
    the wall clock otherwise. Two stamps give seconds through :func:`stamp_seconds`."""
    if device.type != "cuda":
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(torch.cuda.current_stream(device))
    return ev


def stamp_seconds(start, end) -> float:
    """Seconds from stamp ``start`` to stamp ``end`` (on CUDA both must have completed)."""
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3
