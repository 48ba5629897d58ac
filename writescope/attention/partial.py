"""Partial attention of decode queries over a subset of the cached keys, returning the lse.

Legend: B sequences, Hkv KV heads, G = q_heads / Hkv query heads per KV head (query head h uses
KV head h // G, as HF's ``repeat_kv``), nb blocks of D tokens, dk/dv key/value widths.
Decode queries are laid out ``[B, Hkv, G, dk]`` so each KV head is read once for its group.

Implementations:
- :func:`attend_blocks`: plain torch in float32 (GPU side: the D-windows; also a reference).
- :func:`block_partials`: plain torch, one partial per block of a ping-pong buffer holding
  blocks of many sequences.
- :func:`cpu_attend`: the compute region on the CPU, in place, through torch's CPU
  flash-attention op (which returns the lse), split along the keys so all threads have work.
"""

from __future__ import annotations

import torch

from writescope.attention.merge import merge_stacked

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FALLBACK_CHUNK = 8192  # keys per plain-torch call on the CPU (bounds the float32 temporaries)
MIN_CPU_CHUNK = 512  # keys per (head, chunk) task of the CPU op: measured best 256-512 on the H200 host


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
    vf = _values(k, kf, v, acc)
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


def _values(k: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``v`` in ``acc``: a slice of the converted keys ``kf`` when ``v`` is a view of ``k`` (MLA),
    so the latent is converted once."""
    return kf[..., : v.shape[-1]] if v.data_ptr() == k.data_ptr() and v.stride() == k.stride() else v.to(acc)


def block_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One partial per block (all keys valid), for blocks of any sequences at once.

    Args:
        q: ``[nb, Hkv, G, dk]``: each block's query group, already multiplied by the softmax scale.
        k: ``[nb, Hkv, D, dk]``.
        v: ``[nb, Hkv, D, dv]`` (MLA: the view ``k[..., :dv]``).

    Returns:
        ``(o [nb, Hkv, G, dv], lse [nb, Hkv, G])`` in float32 (float64 for float64 inputs);
        merge per sequence with :func:`writescope.attention.merge.merge_segments`.
    """
    acc = torch.promote_types(k.dtype, torch.float32)
    kf = k.to(acc)
    vf = _values(k, kf, v, acc)
    s = torch.matmul(q.to(acc), kf.transpose(-1, -2))  # [nb, Hkv, G, D]
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    total = p.sum(dim=-1)
    return torch.matmul(p, vf) / total.unsqueeze(-1), m.squeeze(-1) + torch.log(total)


def cpu_attend(
    q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor] | None], scale: float, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of a batch over keys that stay where they are in host memory.

    Args:
        q: ``[B, Hkv, G, dk]`` on the CPU.
        kv: per sequence ``(k [Hkv, n, dk], v [Hkv, n, dv])`` views with per-head contiguous
            rows (any head stride: views of the compute region), n >= 1; or ``None`` (no keys:
            the empty partial).
        scale: softmax scale.
        dv: value width.

    Returns:
        ``(o [B, Hkv, G, dv], lse [B, Hkv, G])`` in float32 (float64 for float64 inputs).

    GQA with equal k/v widths uses torch's ``_scaled_dot_product_flash_attention_for_cpu``.
    That op parallelises over batch x heads only, so each sequence's keys are viewed in place
    as a batch of chunks of ``MIN_CPU_CHUNK``-ish keys (no copy); all chunk partials of all
    sequences are merged by lse in one pass (small ops on the CPU cost a parallel region each).
    Other shapes (MLA's 576/512) use :func:`attend_blocks` in chunks of ``FALLBACK_CHUNK`` keys.
    """
    B, Hkv, G, _ = q.shape
    parts = [None if x is None else _cpu_partials(q[i], x[0], x[1], scale) for i, x in enumerate(kv)]
    acc = torch.promote_types(q.dtype, torch.float32)
    width = max([p[0].shape[0] for p in parts if p is not None] or [1])
    o = torch.zeros(B, width, Hkv, G, dv, dtype=acc)
    lse = torch.full((B, width, Hkv, G), float("-inf"), dtype=acc)
    for i, p in enumerate(parts):
        if p is not None:
            o[i, : p[0].shape[0]] = p[0]
            lse[i, : p[1].shape[0]] = p[1]
    if width == 1:
        return o[:, 0], lse[:, 0]
    return merge_stacked(o, lse, dim=1)


def _cpu_partials(q, k, v, scale):
    """Unmerged partials of one sequence: ``(o [P, Hkv, G, dv], lse [P, Hkv, G])``."""
    Hkv, n, dk = k.shape
    assert n >= 1, "cpu_attend needs at least one key per listed sequence"
    if v.shape[-1] != dk or k.stride(-1) != 1 or v.stride(-1) != 1:
        parts = [
            attend_blocks(q[None], k[None, None, :, s : s + FALLBACK_CHUNK], v[None, None, :, s : s + FALLBACK_CHUNK], scale)
            for s in range(0, n, FALLBACK_CHUNK)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    chunks = max(1, n // MIN_CPU_CHUNK)
    c = n // chunks
    qb = q.unsqueeze(0)  # [1, Hkv, G, dk]
    kc = k.as_strided((chunks, Hkv, c, dk), (c * k.stride(1), k.stride(0), k.stride(1), 1), k.storage_offset())
    vc = v.as_strided((chunks, Hkv, c, dk), (c * v.stride(1), v.stride(0), v.stride(1), 1), v.storage_offset())
    o, lse = _cpu_flash(qb.expand(chunks, -1, -1, -1), kc, vc, scale=scale)  # [chunks, Hkv, G, dv], [chunks, Hkv, G]
    if c * chunks < n:  # the tail that does not fill a chunk
        o2, lse2 = _cpu_flash(qb, k[None, :, c * chunks :], v[None, :, c * chunks :], scale=scale)
        o, lse = torch.cat((o, o2)), torch.cat((lse, lse2))
    return o, lse
