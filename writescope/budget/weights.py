"""Weight bytes by kind, from the config alone (no model is built).

Counts follow the modules of :mod:`writescope.models` (HF names, one tensor per expert): the test
checks them against a model built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

from writescope.config import ModelConfig


@dataclass(frozen=True)
class WeightSizes:
    """Parameter counts (elements, not bytes) of one model.

    Attributes:
        non_expert: embeddings, lm_head, attention, norms, routers, shared experts, dense MLPs:
            everything that stays on the GPU.
        expert: one routed expert (gate, up and down projections).
        num_experts: routed experts per MoE layer.
        moe_layers: layers with routed experts.
    """

    non_expert: int
    expert: int
    num_experts: int
    moe_layers: int

    @property
    def routed(self) -> int:
        return self.expert * self.num_experts * self.moe_layers

    @property
    def total(self) -> int:
        return self.non_expert + self.routed


def weight_sizes(cfg: ModelConfig) -> WeightSizes:
    """Parameter counts of ``cfg``'s model by kind (see :class:`WeightSizes`)."""
    H, a, m = cfg.hidden_size, cfg.attention, cfg.moe
    b = 1 if a.bias else 0
    if a.kind == "mla":
        qd = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = H * a.q_heads * qd if a.q_lora_rank is None else (H + b) * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.q_heads * qd
        attn = (
            q
            + (H + b) * (a.kv_lora_rank + a.qk_rope_head_dim)  # kv_a_proj_with_mqa
            + a.kv_lora_rank  # kv_a_layernorm
            + a.kv_lora_rank * a.q_heads * (a.qk_nope_head_dim + a.v_head_dim)  # kv_b_proj
            + a.q_heads * a.v_head_dim * H + b * H  # o_proj
        )
    else:
        d = a.head_dim
        attn = (H + b) * a.q_heads * d + 2 * (H + b) * a.kv_heads * d + a.q_heads * d * H
        if a.qk_norm:
            attn += 2 * d
    expert = 3 * H * m.intermediate_size
    per_layer_fixed = attn + 2 * H  # + input / post-attention norms
    moe = len(m.moe_layers)
    dense = cfg.num_layers - moe
    non_expert = (
        cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2)
        + H  # final norm
        + cfg.num_layers * per_layer_fixed
        + moe * (m.num_experts * H + m.n_shared_experts * expert)  # routers + shared experts
        + dense * 3 * H * m.dense_intermediate_size
    )
    return WeightSizes(non_expert, expert, m.num_experts, moe)
