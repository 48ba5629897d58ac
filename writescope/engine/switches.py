"""The runtime's environment switches (``WRITESCOPE_*``), checked together before any weight loads.

Each switch has one reader next to the code it steers (it names the variable, the value and the
choices when the value is bad); this module only gathers them, so ``LLM`` can read every one
when it starts instead of failing at the first forward, minutes later, or never under a policy
that does not use it. ``WRITESCOPE_CPU_ATTENTION``, ``WRITESCOPE_CPU_ISA`` and
``WRITESCOPE_CPU_TUNING`` are checked by :func:`writescope.attention.cpu_kernel.prepare`, which
``LLM`` calls before the weights load too (it also builds the kernel).
"""

from __future__ import annotations

from typing import Callable

import torch


def readers() -> dict[str, Callable[[], object]]:
    """Switch name -> its reader (raises ValueError on a bad value)."""
    from writescope.attention.cpu_worker import pin_wanted, preread_from_env
    from writescope.attention.split import load_copies_from_env, _cpu_partial_in_place, _native_wanted, _own_load_stream
    from writescope.engine.threads import attention_threads_from_env
    from writescope.kvcache.huge_pages import huge_pages_wanted
    from writescope.env import env_choice
    from writescope.layers.attention import mla_prefill_mode
    from writescope.moe import async_experts, cpu_experts
    from writescope.scheduler.expert_work import balance_from_env
    from writescope.scheduler.policies import compute_last_from_env
    from writescope.scheduler.roofline import link_fixed_from_env
    from writescope.kvcache.inplace import _micro_batches, _prefill_load_on_evict_stream, read_ahead_from_env
    from writescope.kvcache.spec import load_read_from_env, pingpong_buffers_from_env
    from writescope.models.graphs import graphs_wanted
    from writescope.engine.prefill_order import prefill_order_from_env
    from writescope.moe.fused_decode import env_fused
    from writescope.native.team import team_wanted
    from writescope.models.decode_step import graph_split_wanted

    return {
        "WRITESCOPE_MICRO_BATCHES": _micro_batches,
        "WRITESCOPE_MOE_KERNEL": env_fused,
        "WRITESCOPE_LOAD_READ": load_read_from_env,
        "WRITESCOPE_LOAD_STREAM": _own_load_stream,
        "WRITESCOPE_LOAD_COPIES": load_copies_from_env,
        "WRITESCOPE_PINGPONG_BUFFERS": pingpong_buffers_from_env,
        "WRITESCOPE_GPU_ATTENTION": lambda: env_choice("WRITESCOPE_GPU_ATTENTION", ("triton", "torch")),
        "WRITESCOPE_CUDA_GRAPHS": lambda: graphs_wanted(torch.device("cpu")),
        "WRITESCOPE_PREFILL_LOAD_STREAM": _prefill_load_on_evict_stream,
        "WRITESCOPE_PREFILL_READ_AHEAD": read_ahead_from_env,
        "WRITESCOPE_PREFILL_ORDER": prefill_order_from_env,
        "WRITESCOPE_CPU_WORKER": _native_wanted,
        "WRITESCOPE_CPU_PARTIAL": _cpu_partial_in_place,
        "WRITESCOPE_GPU_TILES": _tiles,
        "WRITESCOPE_MLA_PREFILL": mla_prefill_mode,
        "WRITESCOPE_EXPERT_ISA": cpu_experts.requested_path,
        "WRITESCOPE_PINNED_POOL": _pinned_pool,
        "WRITESCOPE_CPU_TUNING": _cpu_tuning,
        "WRITESCOPE_CPU_THREADS": attention_threads_from_env,
        "WRITESCOPE_CPU_PIN": pin_wanted,
        "WRITESCOPE_HUGE_PAGES": huge_pages_wanted,
        "WRITESCOPE_CPU_PREREAD": preread_from_env,
        "WRITESCOPE_EXPERT_WORKER": lambda: async_experts.worker_wanted(torch.device("cpu")),
        "WRITESCOPE_EXPERT_BALANCE": balance_from_env,
        "WRITESCOPE_CPU_TEAM": team_wanted,
        "WRITESCOPE_GRAPH_SPLIT": graph_split_wanted,
        "WRITESCOPE_GRAPH_EXPERTS": async_experts.graph_wanted,
        "WRITESCOPE_EXPERT_OUTPUT": async_experts.output_in_place,
        "WRITESCOPE_LINK_FIXED": link_fixed_from_env,
        "WRITESCOPE_PROMPT_PLAN": compute_last_from_env,
    }


def _cpu_tuning():
    from writescope.attention import cpu_kernel

    return cpu_kernel.tuning_from_env()


def _pinned_pool():
    from writescope.host_memory import host_memory_total
    from writescope.kvcache.pinned_pool import idle_cap_from_env

    return idle_cap_from_env(host_memory_total())


def _tiles():
    from writescope.attention import gpu_kernel

    return gpu_kernel.tile_settings()


# every switch by name (those cpu_kernel.prepare checks too), for what a run prints it ran under
NAMES = ("WRITESCOPE_MICRO_BATCHES", "WRITESCOPE_MOE_KERNEL", "WRITESCOPE_LOAD_READ", "WRITESCOPE_LOAD_STREAM", "WRITESCOPE_LOAD_COPIES",
         "WRITESCOPE_PINGPONG_BUFFERS", "WRITESCOPE_GPU_ATTENTION", "WRITESCOPE_CUDA_GRAPHS", "WRITESCOPE_PREFILL_LOAD_STREAM", "WRITESCOPE_PREFILL_READ_AHEAD",
         "WRITESCOPE_PREFILL_ORDER", "WRITESCOPE_CPU_WORKER", "WRITESCOPE_CPU_PARTIAL",
         "WRITESCOPE_GPU_TILES", "WRITESCOPE_MLA_PREFILL", "WRITESCOPE_EXPERT_ISA", "WRITESCOPE_CPU_ATTENTION", "WRITESCOPE_CPU_ISA",
         "WRITESCOPE_CPU_TUNING", "WRITESCOPE_PINNED_POOL", "WRITESCOPE_CPU_THREADS", "WRITESCOPE_CPU_PIN",
         "WRITESCOPE_HUGE_PAGES", "WRITESCOPE_CPU_PREREAD", "WRITESCOPE_EXPERT_WORKER",
         "WRITESCOPE_EXPERT_BALANCE", "WRITESCOPE_CPU_TEAM", "WRITESCOPE_GRAPH_SPLIT", "WRITESCOPE_GRAPH_EXPERTS",
         "WRITESCOPE_EXPERT_OUTPUT", "WRITESCOPE_LINK_FIXED", "WRITESCOPE_PROMPT_PLAN")


# switches that change neither the decode kernels nor what a decode step does (the placement's model,
# the order of a prompt's blocks): O and the in-step A and C_cpu are kept across them
# (scheduler/other_work.py, switch_signature)
MODEL_ONLY = ("WRITESCOPE_LINK_FIXED", "WRITESCOPE_PROMPT_PLAN")


OTHER_NAMES = ("WRITESCOPE_API_KEY",)  # read elsewhere (writescope serve's --api-key default), not a switch


def unknown_switches(environ=None) -> list[str]:
    """``WRITESCOPE_*`` variables set in ``environ`` (default ``os.environ``) that no part of the
    runtime reads (a misspelt switch has no effect), each with a close known name where there is
    one: ``"WRITESCOPE_CPU_THREAD (did you mean WRITESCOPE_CPU_THREADS?)"``."""
    import difflib
    import os

    env = os.environ if environ is None else environ
    known = set(NAMES) | set(OTHER_NAMES)
    out = []
    tails = sorted(k[len("WRITESCOPE_"):] for k in known)  # compared without the prefix every name shares
    for name in sorted(n for n in env if n.startswith("WRITESCOPE_") and n not in known):
        close = difflib.get_close_matches(name[len("WRITESCOPE_"):], tails, n=1)
        out.append(f"{name} (did you mean WRITESCOPE_{close[0]}?)" if close else name)
    return out


def check_switches() -> None:
    """Read every switch of :func:`readers` once, and warn of ``WRITESCOPE_*`` variables that are
    no switch (:func:`unknown_switches`).

    Raises:
        ValueError: the first bad value (the reader's message: variable, value, choices).
    """
    for read in readers().values():
        read()
    unknown = unknown_switches()
    if unknown:
        import warnings

        warnings.warn(f"not a WriteScope switch, so it has no effect: {', '.join(unknown)} (the switches: docs/USAGE.md, 'Environment switches', and writescope/engine/switches.py)", stacklevel=3)
