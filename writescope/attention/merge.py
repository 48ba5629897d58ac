"""Exact log-sum-exp merge of partial attentions over disjoint key sets (docs/DESIGN.md section 4).

For partials (o_k, lse_k): lse = log sum_k exp(lse_k), o = sum_k exp(lse_k - lse) * o_k.
Conventions: lse is the natural log in float32; an empty partial is (o = 0, lse = -inf);
merging only empty partials gives (0, -inf), never NaN. (The same rule as FlashInfer's
``merge_state`` and vLLM's ``merge_attn_states``; written here from the formula.)
"""

from __future__ import annotations

from typing import Sequence

import torch


def merge_states(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of partial attention states.

    Args:
        outputs: P tensors ``[batch, q_heads, head_dim]`` (any float dtype, any strides; any
            leading shape works as long as all partials agree).
        lses: P tensors ``[batch, q_heads]``, float32 (float64 allowed), natural log; ``-inf``
            marks an empty partial.

    Returns:
        ``(output, lse)``: output ``[batch, q_heads, head_dim]`` in the promoted dtype of
        ``outputs``; lse ``[batch, q_heads]`` in the promoted dtype of ``lses``.

    Raises:
        ValueError: no partials, mismatched counts or shapes, or an lse that is +inf or NaN
            (a partial with infinite mass cannot be merged: check the producer's scale).
    """
    if len(outputs) == 0 or len(outputs) != len(lses):
        raise ValueError(f"merge_states needs one lse per output and at least one partial, got {len(outputs)} outputs, {len(lses)} lses")
    shape = tuple(lses[0].shape)
    for o, s in zip(outputs, lses):
        if tuple(s.shape) != shape or tuple(o.shape[:-1]) != shape or o.shape[-1] != outputs[0].shape[-1]:
            raise ValueError(
                f"partial shapes disagree: output {tuple(o.shape)} with lse {tuple(s.shape)}, expected "
                f"{shape + (outputs[0].shape[-1],)} and {shape}"
            )
    stacked = torch.stack([s for s in lses])
    if torch.isnan(stacked).any() or torch.isposinf(stacked).any():
        raise ValueError("merge_states got an lse of +inf or NaN: an empty partial has lse = -inf and output 0")
    return merge_unchecked(outputs, lses)


def merge_unchecked(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_states` without the validation (no host synchronisation; hot path)."""
    out_dtype = outputs[0].dtype
    for o in outputs[1:]:
        out_dtype = torch.promote_types(out_dtype, o.dtype)
    lse_dtype = torch.float32
    for s_ in lses:
        lse_dtype = torch.promote_types(lse_dtype, s_.dtype)
    if len(outputs) == 1:
        return outputs[0].to(out_dtype, copy=True), lses[0].to(lse_dtype, copy=True)
    acc = torch.float64 if torch.float64 in (out_dtype, lse_dtype) else torch.float32
    o, lse = merge_stacked(torch.stack([o.to(acc) for o in outputs]), torch.stack([s_.to(acc) for s_ in lses]))
    return o.to(out_dtype), lse.to(lse_dtype)


def merge_stacked(outputs: torch.Tensor, lses: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials stacked along ``dim``: outputs ``[..., P, ..., head_dim]``, lses the same
    without ``head_dim``; computes in the inputs' dtype (use float32 or float64). No validation."""
    m = lses.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all-empty rows: avoid -inf - -inf
    w = torch.exp(lses - m)  # empty partials weigh 0
    total = w.sum(dim=dim)
    out_lse = torch.where(total > 0, m.squeeze(dim) + torch.log(total), torch.full_like(total, float("-inf")))
    o = (w.unsqueeze(-1) * outputs).sum(dim=dim) / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    return o, out_lse


def merge_segments(outputs: torch.Tensor, lses: torch.Tensor, seq_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials grouped by sequence: partial j belongs to sequence ``seq_ids[j]``.

    Args:
        outputs: ``[P, ...heads, head_dim]`` float32/float64.
        lses: ``[P, ...heads]`` same dtype.
        seq_ids: ``[P]`` int64 in ``[0, batch)``, on the same device.
        batch: number of sequences.

    Returns:
        ``(o [batch, ...heads, head_dim], lse [batch, ...heads])``; sequences without partials
        get (0, -inf). A fixed number of kernels whatever P. No validation.
    """
    shape = (batch, *lses.shape[1:])
    idx = seq_ids.view(-1, *([1] * (lses.dim() - 1))).expand_as(lses)
    m = torch.full(shape, float("-inf"), dtype=lses.dtype, device=lses.device).scatter_reduce(0, idx, lses, "amax")
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m.index_select(0, seq_ids))  # [P, ...heads]
    total = torch.zeros(shape, dtype=lses.dtype, device=lses.device).index_add_(0, seq_ids, w)
    o = torch.zeros((*shape, outputs.shape[-1]), dtype=outputs.dtype, device=outputs.device)
    o.index_add_(0, seq_ids, w.unsqueeze(-1) * outputs)
    lse = torch.where(total > 0, m + torch.log(total), torch.full_like(total, float("-inf")))
    return o / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1), lse
