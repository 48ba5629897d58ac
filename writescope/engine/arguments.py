"""What ``LLM`` refuses before it builds anything, in one place: the constructor runs it first,
and ``writescope serve`` runs it before it listens (the model loads once the server answers, so
a bad argument found then would only end the server).

Each check is the one the engine reads its argument with (device, dtype, policy, switches, model
config, ``max_model_len``, the budget's plan), so a value one accepts the other does too.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from writescope.budget.memory import available_memory
from writescope.budget.plan import MemoryPlan, make_plan
from writescope.engine.prefill_order import ORDER_ENV, prefill_order_from_env
from writescope.units import parse_budget
from writescope.config import ModelConfig
from writescope.engine.model_loader import parse_dtype, resolve_config, resolve_device
from writescope.engine.prompts import check_max_model_len
from writescope.engine.switches import check_switches
from writescope.engine.threads import check_cpu_threads
from writescope.errors import ArgError
from writescope.kvcache.spec import DEFAULT_WINDOW, Roofline
from writescope.layers.attention import mla_prefill_mode
from writescope.scheduler.placement import PlacementPolicy
from writescope.scheduler.policies import parse_policy


@dataclass(frozen=True)
class CheckedArguments:
    """What the checks resolved: the device and dtype, the policy that sizes the plan (None:
    ``resident``), the model's config, the effective ``max_model_len`` and the budget's plan
    (None without ``vram_budget``), and the order of the offline prefill's passes (``layer`` or
    ``chunk``: engine/prefill_order.py)."""

    device: torch.device
    dtype: torch.dtype
    sizing: PlacementPolicy | None
    config: ModelConfig
    max_model_len: int
    plan: MemoryPlan | None
    prefill_order: str = "layer"


def check_threads(threads: int | None, name: str = "cpu_threads") -> None:
    """A thread count (``cpu_threads``, ``expert_threads``) when given: 1 to the CPUs this process
    may use (engine/threads.py).

    Raises:
        ArgError: outside that range (names it).
    """
    try:
        check_cpu_threads(threads, name)
    except ValueError as e:
        raise ArgError(str(e), name) from None


def check_share(share) -> None:
    """``expert_stream_share``: None (the device's default and, under ``writescope``, the per-step
    split) or a number in [0, 1].

    Raises:
        ArgError: anything else (NaN, a string such as ``"auto"``: pass None), naming the value.
    """
    if share is None:
        return
    if isinstance(share, bool) or not isinstance(share, numbers.Real) or not 0.0 <= share <= 1.0:
        raise ArgError(f"expert_stream_share must be a number in [0, 1], or None for the default, got {share!r}",
                       "expert_stream_share")


def parse_share(value: str, name: str = "expert_stream_share") -> float | None:
    """An ``expert_stream_share`` given as text (a bench row's setting, the CLI's flag): a number
    in [0, 1], or ``auto`` (None: the device's default and, under ``writescope``, its per-step split).

    Raises:
        ValueError: anything else (names ``name`` and the value).
    """
    if value.strip().lower() == "auto":
        return None
    try:
        share = float(value)
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"{name} {value!r}: give the share of decode's host experts streamed to the GPU, in [0, 1] "
                         "(the CPU computes the rest), or auto")
    return share


def check_arguments(model: str, *, synthetic: bool = False, device: str = "auto", dtype: str | torch.dtype = "auto",
                    max_model_len: int | None = None, prefill_chunk_tokens: int = 8192, policy: str = "resident",
                    window: int = DEFAULT_WINDOW, cpu_threads: int | None = None, vram_budget: int | str | None = None,
                    max_batch: int = 32, num_layers: int | None = None, expert_threads: int | None = None,
                    expert_stream_share: float | None = None, prefill_order: str | None = None) -> CheckedArguments:
    """``LLM``'s arguments of the same names, checked in the order the constructor reads them,
    before any weight, cache or kernel is built (the model's config is read; with a budget, the
    plan is made and checked against this host's memory).

    Raises:
        ArgError (a ValueError naming the argument): the first bad value.
        ValueError: an unknown model, policy or ``WRITESCOPE_*`` switch value, or a plan that
            does not fit (:class:`writescope.budget.plan.PlanDoesNotFit`).
        FileNotFoundError: a checkpoint directory without its config.
    """
    dev = resolve_device(device)
    dt = parse_dtype(dtype, dev)
    if prefill_chunk_tokens < 1:
        raise ArgError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}", "prefill_chunk_tokens")
    sizing = parse_policy(policy, roofline=Roofline(1.0, 1.0))  # the name; sizes the budget plan
    check_switches()  # every WRITESCOPE_* switch, whatever the policy uses
    if prefill_order is None:
        prefill_order = prefill_order_from_env()
    elif prefill_order not in ("layer", "chunk"):
        raise ArgError(f"prefill_order must be 'layer' or 'chunk' (None: {ORDER_ENV}), got {prefill_order!r}", "prefill_order")
    if window < 1:
        raise ArgError(f"window (D) must be >= 1 token, got {window}", "window")
    check_threads(cpu_threads)
    check_threads(expert_threads, "expert_threads")
    check_share(expert_stream_share)
    cfg, _ = resolve_config(model, num_layers, synthetic)
    if cfg.model_type == "deepseek_v2":
        mla_prefill_mode()  # a bad WRITESCOPE_MLA_PREFILL
    limit = cfg.max_position_embeddings
    check_max_model_len(max_model_len, limit)
    length = max_model_len or limit
    plan = None
    if vram_budget is not None:
        if max_batch < 1:
            raise ArgError(f"max_batch must be >= 1, got {max_batch}", "max_batch")
        try:
            budget = parse_budget(vram_budget) if isinstance(vram_budget, str) else int(vram_budget)
        except ValueError as e:
            raise ArgError(f"vram_budget: {e}", "vram_budget") from None
        plan = make_plan(cfg, dt, budget, max_batch, length, 0, sizing, window, prefill_chunk_tokens,
                         available_memory(torch.device("cpu")), prefill_order=prefill_order)
        plan.check()
    return CheckedArguments(dev, dt, sizing, cfg, length, plan, prefill_order)
