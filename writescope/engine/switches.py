"""The runtime's environment switches (``WRITESCOPE_*``), checked together before any weight loads.

Each switch has one reader next to the code it steers (it names the variable, the value and the
choices when the value is bad); this module only gathers them, so ``LLM`` can read every one
when it starts instead of failing at the first forward, minutes later, or never under a policy
that does not use it. ``WRITESCOPE_CPU_ATTENTION``, ``WRITESCOPE_CPU_ISA`` and
``WRITESCOPE_CPU_TUNING`` are checked by :func:`writescope.attention.cpu_kernel.prepare`, and
``WRITESCOPE_EXPERT_ISA`` by :func:`writescope.moe.cpu_experts.prepare` (they also build kernels).
"""

from __future__ import annotations

from typing import Callable

import torch


def readers() -> dict[str, Callable[[], object]]:
    """Switch name -> its reader (raises ValueError on a bad value)."""
    from writescope.attention.split import _native_wanted
    from writescope.env import env_choice
    from writescope.kvcache.inplace import _micro_batches, _prefill_load_on_evict_stream
    from writescope.kvcache.spec import load_read_from_env, pingpong_buffers_from_env
    from writescope.models.graphs import graphs_wanted
    from writescope.moe.fused_decode import env_fused

    return {
        "WRITESCOPE_MICRO_BATCHES": _micro_batches,
        "WRITESCOPE_MOE_KERNEL": env_fused,
        "WRITESCOPE_LOAD_READ": load_read_from_env,
        "WRITESCOPE_PINGPONG_BUFFERS": pingpong_buffers_from_env,
        "WRITESCOPE_GPU_ATTENTION": lambda: env_choice("WRITESCOPE_GPU_ATTENTION", ("triton", "torch")),
        "WRITESCOPE_CUDA_GRAPHS": lambda: graphs_wanted(torch.device("cpu")),
        "WRITESCOPE_PREFILL_LOAD_STREAM": _prefill_load_on_evict_stream,
        "WRITESCOPE_CPU_WORKER": _native_wanted,
    }


def check_switches() -> None:
    """Read every switch of :func:`readers` once.

    Raises:
        ValueError: the first bad value (the reader's message: variable, value, choices).
    """
    for read in readers().values():
        read()
