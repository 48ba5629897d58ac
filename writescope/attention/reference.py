"""Plain-torch causal attention of one sequence's new queries over its cached + new keys.

This is the exact reference every faster path is compared against. It uses
``torch.nn.functional.scaled_dot_product_attention`` with an explicit mask, chunked over
queries so the mask stays small for long prompts.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

QUERY_CHUNK = 4096  # queries per SDPA call at most; bounds the [chunk, keys] mask at 4096 x keys bytes
# Keys wider than FUSED_MAX_DIM (MLA's 576-wide latent) may leave SDPA only its math path, which
# holds float32 scores [q_heads, chunk, keys], their softmax and the mask (about 14 bytes per
# score: a review's peak-memory measurement of the CPU's math path, script not kept): there queries per call are also cut so that stays
# under SCORE_BYTES (the H200 1M-token run asked for 1 GiB of scores and overran a 32 GiB budget).
# Narrower heads with equal key and value widths use the fused kernels, which never hold the
# scores; narrower keys with values of another width (MLA expanded: 192 / 128) are bounded too
# unless a fused kernel takes them on this device (probed once: CUDA's memory-efficient kernel).
FUSED_MAX_DIM = 256
SCORE_BYTES = 768 * 2**20
BYTES_PER_SCORE = 14


def query_chunk(q_heads: int, keys: int, k_dim: int = FUSED_MAX_DIM + 1, v_dim: int | None = None, fused: bool = False) -> int:
    """Queries per SDPA call: at most ``QUERY_CHUNK``; when SDPA may take its math path
    (``k_dim > FUSED_MAX_DIM``, or values narrower or wider than keys without ``fused``, a fused
    kernel known to take them) also few enough that ``BYTES_PER_SCORE`` bytes for each of the
    ``q_heads x chunk x keys`` scores fit ``SCORE_BYTES`` (at least 1)."""
    if k_dim <= FUSED_MAX_DIM and (v_dim is None or v_dim == k_dim or fused):
        return QUERY_CHUNK
    return max(1, min(QUERY_CHUNK, SCORE_BYTES // (BYTES_PER_SCORE * q_heads * max(1, keys))))


@functools.lru_cache(maxsize=None)
def fused_sdpa_available(device: str, dtype: torch.dtype, k_dim: int, v_dim: int) -> bool:
    """Whether SDPA has a fused (never materialising the scores) kernel on ``device`` for keys of
    ``k_dim`` and values of ``v_dim`` with a boolean mask, as :func:`attend_sequence` calls it:
    a tiny call restricted to the fused backends, once per argument set. False off CUDA."""
    if not device.startswith("cuda"):
        return False
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.zeros(1, 2, 4, k_dim, device=device, dtype=dtype)
    k = torch.zeros(1, 2, 8, k_dim, device=device, dtype=dtype)
    v = torch.zeros(1, 2, 8, v_dim, device=device, dtype=dtype)
    mask = torch.ones(4, 8, dtype=torch.bool, device=device)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return True
    except RuntimeError:
        return False


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
    dk, dv = q.shape[-1], v.shape[-1]
    fused = dk <= FUSED_MAX_DIM and dv != dk and fused_sdpa_available(str(q.device), q.dtype, dk, dv)
    start = 0
    while start < n:
        stop = min(n, start + query_chunk(q_heads, total, q.shape[-1], v.shape[-1], fused))
        q_pos = torch.arange(context_len + start, context_len + stop, device=q.device)
        mask = key_pos[None, :] <= q_pos[:, None]  # [chunk, total]
        if sliding_window is not None:
            mask &= key_pos[None, :] > q_pos[:, None] - sliding_window
        # keys past the last query of this chunk are never visible: drop them
        last = context_len + stop
        c = stop - start
        if kv_heads == 1 and q_heads > 1 and q.shape[-1] > FUSED_MAX_DIM:
            # one shared KV head (MLA's latent) on the math path: the heads become query rows of
            # that head, so the keys are not expanded per head (enable_gqa would copy them q_heads times)
            qt = q[start:stop].transpose(0, 1).reshape(1, 1, q_heads * c, -1)  # [1, 1, q_heads * chunk, k_dim]
            o = F.scaled_dot_product_attention(qt, kt[:, :, :last], vt[:, :, :last], attn_mask=mask[:, :last].repeat(q_heads, 1), scale=scale)
            out[start:stop] = o.view(q_heads, c, -1).transpose(0, 1)
        else:
            qt = q[start:stop].transpose(0, 1).unsqueeze(0)  # [1, q_heads, chunk, k_dim]
            o = F.scaled_dot_product_attention(
                qt, kt[:, :, :last], vt[:, :, :last], attn_mask=mask[:, :last], scale=scale, enable_gqa=kv_heads != q_heads
            )
            out[start:stop] = o[0].transpose(0, 1)
        start = stop
    return out
