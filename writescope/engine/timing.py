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
