"""Routed experts as two grouped GEMMs (``torch._grouped_mm``) instead of a Python loop over experts.

The device-resident experts of a block are packed once into ``w13 [E_dev, 2I, D]`` (gate rows then
up rows) and ``w2 [E_dev, D, I]``; the experts' own parameters become views of these, so packing
does not double the weights. A step sorts its (token, expert) assignments by expert slot, then

    h = X_sorted @ w13[g]^T,   a = silu(h[:, :I]) * h[:, I:],   y = a @ w2[g]^T

for each group g in one call each (torch's grouped GEMM: CUTLASS on sm90 for bf16, a reference
loop on the CPU), then scales by the routing weight and adds into the token rows, as the loop does
(HF ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock``: expert output x weight, index_add).
Assignments of host experts are sorted last, outside every group, and masked out: nothing here
waits for the host (no ``.tolist()``). Assignments are processed in chunks of ``ROW_CHUNK`` rows
so the intermediates stay within the memory plan's activation estimate (3 K I elements per
token, writescope.budget.plan): a chunk holds at most ROW_CHUNK (D + 2I) elements at once.

Shape legend: T tokens, K top-k, D hidden, I expert intermediate size, E_dev device experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from writescope.moe import fused_decode

_SUPPORTED: dict[tuple, bool] = {}
ROW_CHUNK = 8192  # (token, expert) assignments per pair of grouped GEMMs


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether ``torch._grouped_mm`` runs for these shapes here and matches plain matmuls (one
    probe per device type, dtype and shape; cached). False on torch builds without it, or where
    the kernel rejects the dtype or alignment (e.g. fp32 on CUDA)."""
    key = (device.type, dtype, hidden, inter)
    if key not in _SUPPORTED:
        _SUPPORTED[key] = _probe(device, dtype, hidden, inter)
    return _SUPPORTED[key]


def _probe(device, dtype, hidden, inter) -> bool:
    """Both GEMMs of a step on the real layouts (w13^T then w2^T, whose contraction width is I),
    with an empty group and a trailing row outside every group, against plain matmuls."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, hidden, generator=g).to(device, dtype)
    w13 = (torch.randn(3, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
    w2 = (torch.randn(3, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32, device=device)  # row 5 is in no group
    try:
        h = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    ref = []
    for e, (lo, hi) in enumerate(((0, 2), (2, 2), (2, 5))):
        hr = x[lo:hi].float() @ w13[e].float().t()
        ref.append((F.silu(hr[:, :inter]) * hr[:, inter:]) @ w2[e].float().t())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return bool(torch.allclose(y[:5].float(), torch.cat(ref), rtol=tol, atol=tol))


def grouped_swiglu(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, inter: int) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` of each group of rows of ``xs`` ``[n, D]`` with its expert's
    weights ``w13 [G, 2I, D]`` (gate rows, then up) and ``w2 [G, D, I]``; ``offs [G]`` int32 group
    ends. Rows past ``offs[-1]`` come out undefined. Returns ``[n, D]``."""
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [n, 2I]
    a = F.silu(h[:, :inter]) * h[:, inter:]
    del h
    return torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)


class PackedExperts:
    """The device experts of one block, packed (see module doc).

    Args:
        experts: the block's expert modules (``GatedMLP``), all of them.
        device_ids: ids of the experts packed (all on one device), ascending.
        names: the experts' (gate, up, down) parameter names.
        pin: host experts only: pack into page-locked memory, so they can be streamed to the GPU
            asynchronously (writescope.moe.streaming).

    The packed tensors live on the experts' device; each packed expert's parameters are replaced
    by views of them.
    """

    def __init__(self, experts, device_ids: list[int], names: tuple[str, str, str], pin: bool = False):
        gate, up, down = names
        self.num_experts = len(experts)
        self.ids = list(device_ids)
        first = getattr(experts[self.ids[0]], gate).weight
        self.inter, self.hidden = first.shape
        G, I, D, dt, dev = len(self.ids), self.inter, self.hidden, first.dtype, first.device
        del first  # held here, the first expert's original would outlive its packing
        if pin:
            from writescope.kvcache.pinned import host_empty

            self.w13, self.w2 = host_empty((G, 2 * I, D), dt, pin=True), host_empty((G, D, I), dt, pin=True)
        else:
            self.w13, self.w2 = torch.empty((G, 2 * I, D), dtype=dt, device=dev), torch.empty((G, D, I), dtype=dt, device=dev)
        # expert by expert: its weights copied in, then replaced by views of the pack (no second copy), so the
        # original goes at once where nothing else holds it. Memory then grows by about one expert while packing,
        # not by the layer's experts twice over (a list of concatenations and the stack of it: 3 GiB above the
        # weights for Qwen3-30B-A3B in float32, which the memory check before a build does not count)
        with torch.no_grad():  # with autograd on, the packed tensors' graph would keep every original weight alive
            for s, e in enumerate(self.ids):
                ex = experts[e]
                self.w13[s, :I].copy_(getattr(ex, gate).weight)
                self.w13[s, I:].copy_(getattr(ex, up).weight)
                self.w2[s].copy_(getattr(ex, down).weight)
                getattr(ex, gate).weight = torch.nn.Parameter(self.w13[s, :I], requires_grad=False)
                getattr(ex, up).weight = torch.nn.Parameter(self.w13[s, I:], requires_grad=False)
                getattr(ex, down).weight = torch.nn.Parameter(self.w2[s], requires_grad=False)
        slot = torch.full((self.num_experts,), len(self.ids), dtype=torch.long)  # host experts: one past the last group
        slot[self.ids] = torch.arange(len(self.ids))
        self.slot_of = slot.to(self.w13.device)
        self.index = {e: s for s, e in enumerate(self.ids)}  # expert id -> packed slot (host-side lookups)
        # weight bytes of one expert (w13 and w2): what streaming it or computing it on the CPU reads
        self.expert_nbytes = (self.w13[0].numel() * self.w13.element_size() + self.w2[0].numel() * self.w2.element_size()) if self.ids else 0

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Add the device experts' weighted outputs into ``out``.

        Args:
            x: ``[T, D]`` tokens on the device.
            weights: ``[T, K]`` float32 routing weights; ids: ``[T, K]`` int64 expert ids.
            out: ``[T, D]``, float32 (or x's dtype); accumulated into in place.
        """
        if out.dtype == torch.float32 and fused_decode.wanted(x, ids.numel()):  # decode: two Triton launches (fused_decode.py)
            fused_decode.fused_experts_into(x, weights, ids, self.slot_of, self.w13, self.w2, self.inter, out)
            return
        K, G = ids.shape[1], len(self.ids)
        slot = self.slot_of[ids.flatten()]  # [T*K]
        order = torch.argsort(slot, stable=True)
        slot_sorted = slot[order]
        # per-slot counts by scatter_add: CUDA's bincount reads the max back to the host (a sync)
        counts = torch.zeros(G + 1, dtype=torch.long, device=slot.device).scatter_add_(0, slot, torch.ones_like(slot))
        ends = counts[:G].cumsum(0)  # [G] group ends over all rows
        w_sorted = weights.flatten()[order]
        rows = order.numel()
        for start in range(0, rows, ROW_CHUNK):
            stop = min(rows, start + ROW_CHUNK)
            offs = (ends - start).clamp(0, stop - start).to(torch.int32)  # this chunk's part of each group
            token_of = order[start:stop] // K
            y = grouped_swiglu(x[token_of], self.w13, self.w2, offs, self.inter)  # [n, D]
            y.mul_(w_sorted[start:stop, None].to(y.dtype))
            # rows past the last group (host experts) are never computed: overwrite, never multiply, them
            y.masked_fill_((slot_sorted[start:stop] >= G)[:, None], 0)
            out.index_add_(0, token_of, y.to(out.dtype))
