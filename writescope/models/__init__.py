"""Model registry: HF ``model_type`` -> layer builder, and model construction."""

from __future__ import annotations

import torch

from writescope.config import ModelConfig
from writescope.models import deepseek_v2, mixtral, qwen3_moe
from writescope.models.causal_lm import CausalLM

LAYER_BUILDERS = {
    "qwen3_moe": qwen3_moe.build_layer,
    "mixtral": mixtral.build_layer,
    "deepseek_v2": deepseek_v2.build_layer,
}


def build_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, host_experts: dict[int, range] | None = None
) -> CausalLM:
    """An uninitialised model (storage allocated, values undefined) in ``dtype`` on ``device``.

    Built on the meta device first, so no time is spent on default initialisation.
    ``host_experts`` (``{layer id: routed expert ids}``, from a memory plan) are allocated in
    host memory instead, so they never take device memory.
    """
    with torch.device("meta"):
        model = CausalLM(cfg, LAYER_BUILDERS[cfg.model_type]).to(dtype)
    on_host = set()
    for i, ids in (host_experts or {}).items():
        experts = model.model.layers[i].mlp_module.experts
        on_host |= {id(p) for e in ids for p in experts[e].parameters()}
    model._apply(lambda t: torch.empty_like(t, device="cpu" if id(t) in on_host else device))  # to_empty, per tensor
    model.tie_weights()
    return model.eval()


__all__ = ["build_model", "CausalLM", "LAYER_BUILDERS"]
