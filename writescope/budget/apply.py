"""Apply a memory plan to a loaded model: keep the planned routed experts on the device, move
the rest to host memory, and make the device enforce the budget (docs/DESIGN.md section 6)."""

from __future__ import annotations

import torch

from writescope.budget.plan import MemoryPlan
from writescope.moe.block import SparseMoeBlock


def place_experts(model: torch.nn.Module, plan: MemoryPlan) -> int:
    """Offload all but ``plan.experts_gpu_per_layer[i]`` routed experts of the i-th MoE layer
    (the lowest ids stay; no routing statistics are used yet). Returns the experts offloaded."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == len(plan.experts_gpu_per_layer), f"{len(blocks)} MoE blocks, plan for {len(plan.experts_gpu_per_layer)}"
    moved = 0
    for block, keep in zip(blocks, plan.experts_gpu_per_layer):
        block.offload_experts(range(keep, block.cfg.num_experts))
        moved += block.cfg.num_experts - keep
    return moved


def enforce_budget(device: torch.device, budget: int) -> None:
    """Cap the CUDA caching allocator of this process at ``budget`` bytes on ``device``
    (``torch.cuda.set_per_process_memory_fraction``; allocations beyond it raise
    OutOfMemoryError). A no-op without CUDA."""
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
