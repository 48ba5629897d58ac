"""Routed experts as two grouped GEMMs (``torch._grouped_mm``) instead of a Python loop over experts.

The device-resident experts of a block are packed once into ``w13 [E_dev, 2I, D]`` (gate rows then
up rows) and ``w2 [E_dev, D, I]``; the experts' own parameters become views of these, so packing
does not double the weights. A step sorts its (token, expert) assignments by expert slot, then

    h = X_sorted @ w13[g]^T,   a = silu(h[:, :I]) * h[:, I:],   y = a @ w2[g]^T

for each group g in one call each (torch's grouped GEMM: CUTLASS on sm90 for bf16, a reference
loop on the CPU), then scales by the routing weight and adds into the token rows, as the loop does
(HF ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock``: expert output x weight, index_add).
Assignments of host experts are sorted last, outside every group, and masked out: nothing here
waits for the host (no ``.tolist()``).

Shape legend: T tokens, K top-k, D hidden, I expert intermediate size, E_dev device experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SUPPORTED: dict[tuple, bool] = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether ``torch._grouped_mm`` runs for these shapes here and matches plain matmuls (one
    probe per device type, dtype and shape; cached). False on torch builds without it, or where
    the kernel rejects the dtype or alignment (e.g. fp32 on CUDA)."""
    key = (device.type, dtype, hidden, inter)
    if key not in _SUPPORTED:
        _SUPPORTED[key] = _probe(device, dtype, hidden, inter)
    return _SUPPORTED[key]


def _probe(device, dtype, hidden, inter) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, hidden, generator=g).to(device, dtype)
    w = torch.randn(3, 2 * inter, hidden, generator=g).to(device, dtype) / hidden**0.5
    offs = torch.tensor([2, 2, 5], dtype=torch.int32, device=device)
    try:
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    ref = torch.cat([x[:2] @ w[0].t(), x[2:5] @ w[2].t()])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return bool(torch.allclose(y[:5].float(), ref.float(), rtol=tol, atol=tol))


class PackedExperts:
    """The device experts of one block, packed (see module doc).

    Args:
        experts: the block's expert modules (``GatedMLP``), all of them.
        device_ids: ids of the experts on the device, ascending.
        names: the experts' (gate, up, down) parameter names.

    The packed tensors live on the experts' device; each device expert's parameters are replaced
    by views of them.
    """

    def __init__(self, experts, device_ids: list[int], names: tuple[str, str, str]):
        gate, up, down = names
        self.num_experts = len(experts)
        self.ids = list(device_ids)
        first = getattr(experts[self.ids[0]], gate).weight
        self.inter, self.hidden = first.shape
        self.w13 = torch.stack([torch.cat((getattr(experts[e], gate).weight, getattr(experts[e], up).weight)) for e in self.ids])
        self.w2 = torch.stack([getattr(experts[e], down).weight for e in self.ids])
        for s, e in enumerate(self.ids):  # views of the packed weights: no second copy
            getattr(experts[e], gate).weight = torch.nn.Parameter(self.w13[s, : self.inter], requires_grad=False)
            getattr(experts[e], up).weight = torch.nn.Parameter(self.w13[s, self.inter :], requires_grad=False)
            getattr(experts[e], down).weight = torch.nn.Parameter(self.w2[s], requires_grad=False)
        slot = torch.full((self.num_experts,), len(self.ids), dtype=torch.long)  # host experts: one past the last group
        slot[self.ids] = torch.arange(len(self.ids))
        self.slot_of = slot.to(self.w13.device)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Add the device experts' weighted outputs into ``out``.

        Args:
            x: ``[T, D]`` tokens on the device.
            weights: ``[T, K]`` float32 routing weights; ids: ``[T, K]`` int64 expert ids.
            out: ``[T, D]``, x's dtype; accumulated into in place.
        """
        K, G = ids.shape[1], len(self.ids)
        slot = self.slot_of[ids.flatten()]  # [T*K]
        order = torch.argsort(slot, stable=True)
        token_of = order // K
        offs = torch.bincount(slot, minlength=G + 1)[:G].cumsum(0).to(torch.int32)
        xs = x[token_of]  # [T*K, D]
        h = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs)  # [T*K, 2I]
        a = F.silu(h[:, : self.inter]) * h[:, self.inter :]
        y = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)  # [T*K, D]
        w = weights.flatten()[order].to(y.dtype)
        # rows past the last group (host experts) are not computed: select, never multiply, them away
        y = torch.where((slot[order] < G)[:, None], y * w[:, None], torch.zeros((), dtype=y.dtype, device=y.device))
        out.index_add_(0, token_of, y)
