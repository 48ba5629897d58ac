"""DeepSeek-V2 (its published modeling code; HF ``modeling_deepseek_v2.py``): MLA, YaRN rope,
shared experts, the first ``first_k_dense_replace`` layers dense."""

from writescope.config import ModelConfig
from writescope.layers.attention import MLAAttention
from writescope.layers.mlp import GatedMLP
from writescope.moe.block import SparseMoeBlock


def build_layer(cfg: ModelConfig, i: int):
    attn = MLAAttention(cfg.attention, cfg.hidden_size, cfg.rms_norm_eps, i)
    if i in cfg.moe.moe_layers:
        return attn, SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=True)
    return attn, GatedMLP(cfg.hidden_size, cfg.moe.dense_intermediate_size)
