"""Top-k softmax routing, computed in float32.

Sources: HF ``Qwen3MoeTopKRouter`` and ``MixtralTopKRouter`` (softmax over all experts, top-k,
renormalise when ``norm_topk_prob``; Mixtral always renormalises); DeepSeek-V2's own modeling
code (``DeepseekV2MoEGate``, greedy top-k: renormalise when top_k > 1 and ``norm_topk_prob``,
otherwise multiply by ``routed_scaling_factor``). HF transformers 5.x's DeepSeek-V2 port ignores
``norm_topk_prob``; the published config sets it false, where both agree.
"""

from __future__ import annotations

import torch

from writescope.config import MoEConfig


def route(x: torch.Tensor, gate_weight: torch.Tensor, cfg: MoEConfig, deepseek: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Select experts.

    Args:
        x: ``[T, hidden]`` any float dtype.
        gate_weight: ``[E, hidden]`` router weight.
        cfg: routing flags.
        deepseek: use DeepSeek-V2's weighting rule (see module doc).

    Returns:
        weights ``[T, top_k]`` float32, expert ids ``[T, top_k]`` int64.
    """
    logits = x.float() @ gate_weight.float().t()  # [T, E]
    probs = logits.softmax(dim=-1)
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if deepseek:
        if cfg.top_k > 1 and cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * cfg.routed_scaling_factor
    elif cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
