"""Rotary position embedding, plain and YaRN.

Formulas: RoFormer (arXiv 2104.09864); YaRN (arXiv 2309.00071) as Hugging Face implements it
in ``transformers/modeling_rope_utils.py::_compute_yarn_parameters`` (correction range with
floor/ceil truncation unless ``truncate`` is false, linear ramp between interpolated and extrapolated frequencies, cos/sin
scaled by ``attention_factor`` when given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
when both are non-zero, else mscale(factor)).
"""

from __future__ import annotations

import math

import torch

from writescope.config import RopeConfig, yarn_get_mscale


def inv_frequencies(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim/2]`` float32 (CPU) and the cos/sin attention factor."""
    dim, base = cfg.dim, cfg.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if cfg.scaling is None:
        return 1.0 / pos_freqs, 1.0
    factor = cfg.factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    if cfg.attention_factor is not None:
        attention_factor = cfg.attention_factor
    elif cfg.mscale and cfg.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, cfg.mscale) / yarn_get_mscale(factor, cfg.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor, 1.0)
    return inv, attention_factor


class RotaryEmbedding:
    """cos/sin tables for given positions, and their application to q or k.

    Not an ``nn.Module``: it holds no checkpoint state; frequencies are recomputed per device.
    """

    def __init__(self, cfg: RopeConfig):
        self.cfg = cfg
        self._inv, self.attention_factor = inv_frequencies(cfg)
        self._per_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64 -> (cos, sin), each ``[T, dim/2]`` float32."""
        inv = self._per_device.get(positions.device)
        if inv is None:
            inv = self._per_device.setdefault(positions.device, self._inv.to(positions.device))
        freqs = positions.float()[:, None] * inv[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[T, heads, dim]`` -> rotated x, same dtype; computed in float32.

        Pairing: (2i, 2i+1) when ``interleaved`` (DeepSeek-V2), else (i, i + dim/2).
        """
        xf = x.float()
        c, s = cos[:, None, :], sin[:, None, :]
        if self.cfg.interleaved:
            a, b = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            a, b = xf[..., :half], xf[..., half:]
            out = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
        return out.to(x.dtype)
