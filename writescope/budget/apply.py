"""Apply a memory plan to a loaded model: keep the planned routed experts on the device, move
the rest to host memory, and make the device enforce the budget (docs/DESIGN.md section 6)."""

from __future__ import annotations

import warnings

import torch

from writescope.budget.plan import MemoryPlan
from writescope.errors import ArgError
from writescope.moe.block import SparseMoeBlock


def host_experts(cfg, plan: MemoryPlan, profile=None) -> dict[int, list[int]]:
    """``{layer id: routed expert ids in host memory}``: of the i-th MoE layer, all but the
    ``plan.experts_gpu_per_layer[i]`` that stay on the device: the most chosen ones of
    ``profile`` (an :class:`~writescope.moe.popularity.ExpertProfile`, checked against the
    model), or without one the lowest ids. Given to the model builder so host experts are made in
    host memory and never occupy the device.

    Raises:
        ValueError: a profile that does not match the model (see ``ExpertProfile.check``).
    """
    layers, E = cfg.moe.moe_layers, cfg.moe.num_experts
    assert len(layers) == len(plan.experts_gpu_per_layer), f"{len(layers)} MoE layers, plan for {len(plan.experts_gpu_per_layer)}"
    if profile is not None:
        profile.check(list(layers), E)
    out = {}
    for i, keep in zip(layers, plan.experts_gpu_per_layer):
        if keep < E:
            on_gpu = set(profile.hot(i, keep)) if profile is not None else set(range(keep))
            out[i] = [e for e in range(E) if e not in on_gpu]
    return out


def place_experts(model: torch.nn.Module, plan: MemoryPlan, profile=None) -> int:
    """Mark (and, where they are not there yet, move) the plan's host experts of every MoE layer
    (see :func:`host_experts`). Returns the experts in host memory."""
    where = host_experts(model.config, plan, profile)
    moved = 0
    for i, layer in enumerate(model.model.layers):
        block = layer.mlp_module
        if isinstance(block, SparseMoeBlock):
            ids = where.get(i, [])
            block.offload_experts(ids)
            moved += len(ids)
    return moved


def enforce_budget(device: torch.device, budget: int, planned: int | None = None, working: int = 0) -> dict:
    """Cap the CUDA caching allocator of this process at ``budget`` bytes on ``device``
    (``torch.cuda.set_per_process_memory_fraction``; allocations beyond it raise
    OutOfMemoryError). Without CUDA: no cap, returns {}.

    ``planned``: the bytes the plan gave the weights; ``working``: the bytes it keeps for the
    rest (KV on the device, ping-pong, activations, streaming slots). Returns
    ``{"allocated": bytes in tensors, "reserved": bytes the allocator holds}`` at the moment the
    cap is set (after releasing its unused cache). Warns (``RuntimeWarning``, shown by default) when
    ``reserved + working`` passes the budget: the run may run out of device memory later.

    Raises:
        ValueError: the process already holds more than ``budget`` minus 256 MiB (what is
            loaded took more than ``planned``, e.g. through allocator fragmentation): the run
            would fail at its first allocation, so it is refused here with the numbers.
    """
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()  # the call needs an index
    torch.cuda.empty_cache()
    held = {"allocated": torch.cuda.memory_allocated(index), "reserved": torch.cuda.memory_reserved(index)}
    if held["reserved"] > budget - 256 * 2**20:
        gib = 2**30
        raise ArgError(
            f"after loading the weights this process holds {held['reserved'] / gib:.2f} GiB of device memory "
            f"({held['allocated'] / gib:.2f} GiB in tensors{'' if planned is None else f', {planned / gib:.2f} GiB planned'}), "
            f"leaving nothing of the vram_budget of {budget / gib:.2f} GiB for the KV and activations: raise the budget, "
            "or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation; the CLI does) before starting",
            "vram_budget",
        )
    total = torch.cuda.get_device_properties(index).total_memory
    if held["reserved"] + working > budget:
        gib = 2**30
        warnings.warn(
            f"after loading the weights this process holds {held['reserved'] / gib:.2f} GiB of device memory"
            f"{'' if planned is None else f' ({planned / gib:.2f} GiB planned)'}; with the {working / gib:.2f} GiB the plan "
            f"keeps for KV and activations that passes the VRAM budget (vram_budget, --vram-budget) of {budget / gib:.2f} GiB: "
            "the run may run out of device memory (fewer requests, a shorter context or smaller prefill chunks, "
            "prefill_chunk_tokens / --prefill-chunk-tokens, help)",
            RuntimeWarning, stacklevel=2,
        )
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)
    return held


def coverage_line(cfg, plan: MemoryPlan, profile) -> str:
    """What the plan's GPU experts serve of ``profile``'s routing, in words: the share of all
    profiled assignments that go to experts on the device, placed by popularity and, for
    comparison, by lowest id (``writescope plan --expert-profile``)."""
    layers = list(cfg.moe.moe_layers)
    profile.check(layers, cfg.moe.num_experts)
    total = sum(sum(profile.layers[i]) for i in layers) or 1.0
    hot = sum(sum(profile.layers[i][e] for e in profile.hot(i, k)) for i, k in zip(layers, plan.experts_gpu_per_layer))
    low = sum(sum(profile.layers[i][:k]) for i, k in zip(layers, plan.experts_gpu_per_layer))
    return (f"routed experts on the GPU serve {hot / total:.1%} of the profiled assignments placed by popularity "
            f"({low / total:.1%} by lowest id; profile {profile.source or profile.model}, {profile.tokens:,} tokens)")
