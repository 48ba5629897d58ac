"""Named ranges for torch's profiler that cost nothing when no profiler runs.

``torch.profiler.record_function`` enters and leaves a profiler op on every use, profiler or not:
about 10 us per range on the H200 host's main thread, nine ranges per layer of a decode step
(benchmarks/results/gpu_decode_h200.md, run 29: the main thread's own profile). :func:`named`
gives the range only while a profiler is enabled (``writescope profile``'s breakdown), and a
shared no-op context otherwise.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.profiler import record_function

_NONE = nullcontext()
_enabled = torch._C._autograd._profiler_enabled


def named(name: str):
    """``record_function(name)`` while torch's profiler is enabled, else a no-op context."""
    return record_function(name) if _enabled() else _NONE
