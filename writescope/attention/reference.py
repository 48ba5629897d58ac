"""Plain-torch causal attention of one sequence's new queries over its cached + new keys.

This is the exact reference every faster path is compared against. It uses
``torch.nn.functional.scaled_dot_product_attention`` with an explicit mask, chunked over
queries so the mask stays small for long prompts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_CHUNK = 4096  # queries per SDPA call; bounds the [chunk, keys] mask at 4096 x keys bytes


def attend_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``n`` new queries over ``context_len + n`` keys.

    Args:
        q: ``[n, q_heads, k_dim]``; query j sits at position ``context_len + j``.
        k: ``[context_len + n, kv_heads, k_dim]``, q_heads a multiple of kv_heads (GQA; MLA
            passes kv_heads = 1).
        v: ``[context_len + n, kv_heads, v_dim]`` (v_dim may differ from k_dim, as in MLA).
        scale: softmax scale (1/sqrt(head_dim), or MLA's YaRN-corrected scale).
        sliding_window: if set, query at position p sees keys at positions > p - sliding_window
            (HF ``masking_utils.sliding_window_overlay``).

    Returns:
        ``[n, q_heads, v_dim]`` in q's dtype.
    """
    n, q_heads, _ = q.shape
    total, kv_heads, _ = k.shape
    assert total == context_len + n, f"keys {total} != context {context_len} + queries {n}"
    assert q_heads % kv_heads == 0, f"q_heads {q_heads} not a multiple of kv_heads {kv_heads}"
    kt = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, total, k_dim]
    vt = v.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, total, v_dim]
    out = q.new_empty(n, q_heads, v.shape[-1])
    key_pos = torch.arange(total, device=q.device)
    for start in range(0, n, QUERY_CHUNK):
        stop = min(n, start + QUERY_CHUNK)
        q_pos = torch.arange(context_len + start, context_len + stop, device=q.device)
        mask = key_pos[None, :] <= q_pos[:, None]  # [chunk, total]
        if sliding_window is not None:
            mask &= key_pos[None, :] > q_pos[:, None] - sliding_window
        # keys past the last query of this chunk are never visible: drop them
        last = context_len + stop
        qt = q[start:stop].transpose(0, 1).unsqueeze(0)  # [1, q_heads, chunk, k_dim]
        o = F.scaled_dot_product_attention(
            qt, kt[:, :, :last], vt[:, :, :last], attn_mask=mask[:, :last], scale=scale, enable_gqa=kv_heads != q_heads
        )
        out[start:stop] = o[0].transpose(0, 1)
    return out
