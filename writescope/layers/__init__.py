"""Building blocks shared by all model files: RMSNorm, rotary embedding, gated MLP, the attention
projections (GQA, MLA)."""

from writescope.layers.attention import GQAAttention, MLAAttention
from writescope.layers.mlp import GatedMLP
from writescope.layers.norm import RMSNorm
from writescope.layers.rope import RotaryEmbedding

__all__ = ["RMSNorm", "RotaryEmbedding", "GatedMLP", "GQAAttention", "MLAAttention"]
