"""Partial attention of decode queries over a subset of the cached keys, returning the lse.

Legend: B sequences, Hkv KV heads, G = q_heads / Hkv query heads per KV head (query head h uses
KV head h // G, as HF's ``repeat_kv``), nb blocks of D tokens, dk/dv key/value widths.
Decode queries are laid out ``[B, Hkv, G, dk]`` so each KV head is read once for its group.

Two implementations:
- :func:`attend_blocks`: plain torch in float32 (GPU side: D-window, ping-pong chunks; also the
  reference in tests).
- :func:`cpu_attend`: the compute region on the CPU, in place, through torch's CPU
  flash-attention op (which returns the lse), split along the keys so all threads have work.
"""

from __future__ import annotations

import math

import torch

from writescope.attention.merge import merge_unchecked

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FALLBACK_CHUNK = 8192  # keys per plain-torch call on the CPU (bounds the float32 temporaries)


def attend_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per head over blocked keys, in float32.

    Args:
        q: ``[B, Hkv, G, dk]``.
        k: ``[B, nb, Hkv, D, dk]``; token t of block b is key ``b * D + t``.
        v: ``[B, nb, Hkv, D, dv]`` (MLA: the view ``k[..., :dv]``).
        scale: softmax scale.
        lengths: ``[B]`` int64, valid keys per sequence (keys ``>= lengths[b]`` are masked;
            their values must still be finite); ``None`` = all valid. A length of 0 gives the
            empty partial.

    Returns:
        ``(o [B, Hkv, G, dv], lse [B, Hkv, G])`` in float32 (float64 for float64 inputs); empty
        rows are (0, -inf).
    """
    B, nb, Hkv, D, dk = k.shape
    acc = torch.promote_types(k.dtype, torch.float32)
    kf = k.to(acc)
    vf = kf[..., : v.shape[-1]] if v.data_ptr() == k.data_ptr() and v.stride() == k.stride() else v.to(acc)
    s = torch.matmul(q.to(acc).unsqueeze(1), kf.transpose(-1, -2)) * scale  # [B, nb, Hkv, G, D]
    if lengths is not None:
        pos = torch.arange(nb * D, device=k.device).view(1, nb, D)
        masked = pos >= lengths.to(k.device).view(B, 1, 1)  # [B, nb, D]
        s = s.masked_fill(masked[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=(1, 4))  # [B, Hkv, G]
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[:, None, :, :, None])  # masked -> 0
    o = torch.matmul(p, vf).sum(dim=1)  # [B, Hkv, G, dv]
    return o, lse


def cpu_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence's decode queries over keys that stay where they are in host memory.

    Args:
        q: ``[Hkv, G, dk]`` on the CPU.
        k: ``[Hkv, n, dk]`` on the CPU, per-head contiguous rows (any head stride: a view of
            the compute region), n >= 1.
        v: ``[Hkv, n, dv]`` likewise (MLA: a view of the keys' first dv columns).
        scale: softmax scale.
        threads: CPU threads available; the keys are split into enough chunks that
            ``Hkv * chunks >= threads`` (the op parallelises over batch x heads only).

    Returns:
        ``(o [Hkv, G, dv], lse [Hkv, G])`` in float32 (float64 for float64 inputs).

    GQA with equal k/v widths uses torch's ``_scaled_dot_product_flash_attention_for_cpu`` on
    strided chunk views (no copy); other shapes (MLA's 576/512) use :func:`attend_blocks` in
    chunks of ``FALLBACK_CHUNK`` keys.
    """
    Hkv, n, dk = k.shape
    assert n >= 1, "cpu_attend needs at least one key"
    if v.shape[-1] != dk or k.stride(-1) != 1 or v.stride(-1) != 1:
        parts = [
            attend_blocks(q[None], k[None, None, :, s : s + FALLBACK_CHUNK], v[None, None, :, s : s + FALLBACK_CHUNK], scale)
            for s in range(0, n, FALLBACK_CHUNK)
        ]
        o, lse = merge_unchecked([p[0][0] for p in parts], [p[1][0] for p in parts])
        return o, lse
    acc = torch.promote_types(k.dtype, torch.float32)
    chunks = max(1, min(math.ceil(threads / Hkv), n // 256))
    c = n // chunks
    outs, lses = [], []
    qb = q.unsqueeze(0)  # [1, Hkv, G, dk]
    if chunks > 1:
        kc = k.as_strided((chunks, Hkv, c, dk), (c * k.stride(1), k.stride(0), k.stride(1), 1), k.storage_offset())
        vc = v.as_strided((chunks, Hkv, c, dk), (c * v.stride(1), v.stride(0), v.stride(1), 1), v.storage_offset())
        o, lse = _cpu_flash(qb.expand(chunks, -1, -1, -1), kc, vc, scale=scale)  # [chunks, Hkv, G, dv], [chunks, Hkv, G]
        outs += list(o.to(acc).unbind(0))
        lses += list(lse.unbind(0))
    done = c * chunks if chunks > 1 else 0
    if done < n:
        o, lse = _cpu_flash(qb, k[None, :, done:], v[None, :, done:], scale=scale)
        outs.append(o[0].to(acc))
        lses.append(lse[0])
    return merge_unchecked(outs, lses)
