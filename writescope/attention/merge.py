"""Exact log-sum-exp merge of partial attentions over disjoint key sets (DESIGN.md section 4).

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
    lse_dtype = torch.promote_types(lses[0].dtype, torch.float32)
    acc = torch.float64 if torch.float64 in (out_dtype, lse_dtype) else torch.float32
    if len(outputs) == 1:
        return outputs[0].to(out_dtype), lses[0].to(lse_dtype)
    lse = torch.stack([s.to(acc) for s in lses])  # [P, ...]
    m = lse.amax(dim=0)  # [...]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all-empty rows: avoid -inf - -inf
    w = torch.exp(lse - m)  # [P, ...]; empty partials weigh 0
    total = w.sum(dim=0)
    out_lse = torch.where(total > 0, m + torch.log(total), torch.full_like(m, float("-inf")))
    norm = torch.where(total > 0, total, torch.ones_like(total))
    o = sum(wk.unsqueeze(-1) * ok.to(acc) for wk, ok in zip(w, outputs))
    return (o / norm.unsqueeze(-1)).to(out_dtype), out_lse.to(lse_dtype)
