"""Memory on this machine, and the check before a model is built: do its weights and the KV its
requests need fit the host (and device) memory available now?

``LLM`` runs :func:`check_fits` after the budget plan and before any tensor is built, so a run
that cannot fit (Qwen3-30B-A3B's 114 GiB of float32 weights on a 24 GiB CPU machine: 18,867
tensors, minutes of building) is refused at once with the bytes needed, the bytes available
and what to change.
"""

from __future__ import annotations

import torch

from writescope.budget.plan import MemoryPlan
from writescope.budget.weights import weight_sizes
from writescope.config import ModelConfig
from writescope.errors import ArgError, plural
from writescope.host_memory import host_free_now, host_memory_total  # noqa: F401 - imported from here too
from writescope.kvcache import pinned

GiB = 2**30
PLANNED_SHARE = 0.9  # of the memory available, what a run may plan to fill (the rest: the process, the OS)


def available_memory(device: torch.device) -> int | None:
    """Free bytes on ``device`` (CUDA: the driver's free memory; CPU: MemAvailable plus the wholly
    idle mappings of the pinned pool, which it gives back when a new allocation needs the room), or None."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    free = host_free_now()
    if free is None:
        return None
    return free + pinned.POOL.releasable_bytes


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of all of ``cfg``'s weights in ``dtype``."""
    return weight_sizes(cfg).total * dtype.itemsize


def kv_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of the KV of ``tokens`` tokens (summed over the sequences) in every layer."""
    return tokens * cfg.num_layers * cfg.kv_layout.bytes_per_token(dtype.itemsize)


def check_fits(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kv_tokens: int,
    host_free: int | None,
    device_free: int | None = None,
    plan: MemoryPlan | None = None,
    kv_on_device: bool = True,
) -> None:
    """Refuse a run whose memory cannot be had, before anything is built.

    Without a ``plan``: all weights (``dtype``) on ``device`` and the KV of ``kv_tokens`` tokens
    (prompt + new tokens, summed over the requests) on ``device`` (``kv_on_device``: the
    ``resident`` policy) or in host memory (partitioned policies). With a ``plan`` (a
    ``vram_budget``; already checked by :meth:`MemoryPlan.check`): on CUDA its device total
    against the device's free memory; on the CPU, where the "device" is host memory too, its
    device and host parts together. Each side may fill :data:`PLANNED_SHARE` of what is free.
    ``host_free`` / ``device_free``: bytes available now (None: unknown, not checked).

    Raises:
        ArgError: naming the bytes needed and available and what to change (a smaller model,
            fewer layers, a smaller dtype, fewer or shorter requests, a budget), with the API's
            argument names (the CLI words them as its flags).
    """
    if kv_tokens < 0:
        raise ValueError(f"kv_tokens must be >= 0, got {kv_tokens}")
    item = dtype.itemsize
    weights, kv = weight_bytes(cfg, dtype), kv_bytes(cfg, dtype, kv_tokens)
    on_cpu = device.type == "cpu"
    if plan is not None and on_cpu:
        need, what = plan.gpu_total - plan.reserve + plan.host_total, "the plan's device and host parts, both in host memory here"
    elif plan is not None:
        need, what = plan.gpu_total, "the plan's device part (weights, KV, activations, reserve)"
    else:
        dev_kv = kv if kv_on_device or on_cpu else 0
        need = weights + dev_kv
        what = (f"weights {weights / GiB:.2f} GiB ({weight_sizes(cfg).total / 1e9:.2f} B parameters x {item} bytes) "
                f"+ KV {dev_kv / GiB:.2f} GiB ({kv_tokens:,} tokens)")
    free, where, source = (host_free, "host memory", "MemAvailable") if on_cpu else (device_free, f"{device}", "free device memory")
    if free is not None and need > PLANNED_SHARE * free:
        raise ArgError(
            f"{cfg.architecture} ({plural(cfg.num_layers, 'layer')}) in {dtype} needs {need / GiB:.2f} GiB of {where}: {what}; "
            f"{free / GiB:.2f} GiB is available ({source}), of which {PLANNED_SHARE:.0%} ({PLANNED_SHARE * free / GiB:.2f} GiB) "
            f"may be planned. Nothing was built. {_advice(cfg, dtype, device, kv, PLANNED_SHARE * free, plan)}",
            *ADVICE_NAMES,
        )
    if plan is None and not on_cpu and not kv_on_device and host_free is not None and kv > PLANNED_SHARE * host_free:
        raise ArgError(
            f"the requests' KV needs {kv / GiB:.2f} GiB of host memory ({kv_tokens:,} tokens, partitioned policy) but "
            f"{host_free / GiB:.2f} GiB is available (MemAvailable), of which {PLANNED_SHARE:.0%} may be planned. Nothing was "
            "built: use fewer or shorter requests (kv_tokens)",
            *ADVICE_NAMES,
        )


def _advice(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kv: int, room: float, plan: MemoryPlan | None) -> str:
    """What to change, in words with the Python API's argument names (:data:`ADVICE_NAMES`; the CLI
    rewords them as its flags), with the largest ``num_layers`` of this shape that fits ``room``."""
    tips = []
    if plan is None:
        fit = next((n for n in range(cfg.num_layers - 1, 0, -1)
                    if weight_bytes(cfg.with_overrides(num_hidden_layers=n), dtype) + kv * n / cfg.num_layers <= room), None)
        tips.append("a smaller model (e.g. a tiny-* preset)")
        if fit is not None:
            tips.append(f"fewer layers of this shape with synthetic weights (num_layers {fit} fits)")
        if dtype.itemsize > 2:
            tips.append("16-bit weights (dtype bf16: half the bytes)")
    if plan is not None:  # the plan is sized for max_batch requests of max_model_len tokens
        tips.append("fewer or shorter requests (max_batch, max_model_len)")
    elif kv >= 0.05 * room:  # the requests' KV matters
        tips.append("fewer or shorter requests (kv_tokens)")
    if device.type == "cuda":
        tips.append("a vram_budget that fits the device (routed experts beyond it go to host memory)"
                    if plan is None else "a smaller vram_budget (the plan's device part shrinks with it)")
    else:
        tips.append("a machine with more memory, or a GPU (with a vram_budget)")
    return "Use " + "; ".join(tips[:-1]) + "; or " + tips[-1] + "."


ADVICE_NAMES = ("num_layers", "dtype", "kv_tokens", "max_batch", "max_model_len", "vram_budget")
