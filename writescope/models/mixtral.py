"""Mixtral (HF ``modeling_mixtral.py``): GQA, optional sliding window, top-2 renormalised."""

from writescope.config import ModelConfig
from writescope.layers.attention import GQAAttention
from writescope.moe.block import SparseMoeBlock


def build_layer(cfg: ModelConfig, i: int):
    return GQAAttention(cfg.attention, cfg.hidden_size, cfg.rms_norm_eps, i), SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=False)
