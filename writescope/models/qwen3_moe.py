"""Qwen3-MoE (HF ``modeling_qwen3_moe.py``): GQA with q/k RMSNorm, softmax top-k routing."""

from writescope.config import ModelConfig
from writescope.layers.attention import GQAAttention
from writescope.layers.mlp import GatedMLP
from writescope.moe.block import SparseMoeBlock


def build_layer(cfg: ModelConfig, i: int):
    attn = GQAAttention(cfg.attention, cfg.hidden_size, cfg.rms_norm_eps, i)
    if i in cfg.moe.moe_layers:
        return attn, SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=False)
    return attn, GatedMLP(cfg.hidden_size, cfg.moe.dense_intermediate_size)
