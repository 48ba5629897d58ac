"""The sparse MoE block: router + routed experts (+ shared experts for DeepSeek-V2).

Shape legend: T tokens, D hidden, E routed experts, K top-k, I expert intermediate size.
"""

from __future__ import annotations

import torch
from torch import nn

from writescope.config import MoEConfig
from writescope.layers.mlp import GatedMLP
from writescope.moe.router import route


class SparseMoeBlock(nn.Module):
    """y = Σ_k w_k · expert_{id_k}(x) (+ shared_experts(x)).

    Parameter names follow the checkpoints: ``gate.weight`` ``[E, D]``,
    ``experts.{e}.{gate,up,down}`` (Mixtral: ``w1, w3, w2``), ``shared_experts.*``
    (DeepSeek-V2, intermediate ``I · n_shared_experts``).
    """

    def __init__(self, cfg: MoEConfig, hidden: int, deepseek: bool):
        super().__init__()
        self.cfg, self.deepseek = cfg, deepseek
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, cfg.intermediate_size, cfg.expert_names) for _ in range(cfg.num_experts))
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(hidden, cfg.intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, D]`` -> ``[T, D]``, same dtype."""
        weights, ids = route(x, self.gate.weight, self.cfg, self.deepseek)  # [T, K] f32, [T, K]
        out = torch.zeros_like(x)  # [T, D]
        flat = ids.flatten()  # [T*K]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        token_of = order // self.cfg.top_k  # [T*K] token index of each sorted assignment
        w_sorted = weights.flatten()[order]  # [T*K]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start : start + n]
            y = self.experts[e](x[tok])  # [n, D]
            out.index_add_(0, tok, (y * w_sorted[start : start + n, None].to(y.dtype)))
            start += n
        if self.cfg.n_shared_experts:
            out = out + self.shared_experts(x)
        return out
