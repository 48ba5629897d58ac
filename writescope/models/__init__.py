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


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """An uninitialised model (storage allocated, values undefined) in ``dtype`` on ``device``.

    Built on the meta device first, so no time is spent on default initialisation.
    """
    with torch.device("meta"):
        model = CausalLM(cfg, LAYER_BUILDERS[cfg.model_type]).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model.eval()


__all__ = ["build_model", "CausalLM", "LAYER_BUILDERS"]
