"""RMSNorm as Hugging Face computes it (``modeling_qwen3_moe.Qwen3MoeRMSNorm``)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight · (x / sqrt(mean(x²) + eps)), normalised in float32, cast back before the weight.

    Input ``[..., dim]`` of any float dtype; output has the input's dtype (the weight's dtype
    for mixed inputs, as in HF).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
