"""Partial attention of decode queries over a subset of the cached keys, returning the lse.

Legend: B sequences, Hkv KV heads, G = q_heads / Hkv query heads per KV head (query head h uses
KV head h // G, as HF's ``repeat_kv``), nb blocks of D tokens, dk/dv key/value widths.
Decode queries are laid out ``[B, Hkv, G, dk]`` so each KV head is read once for its group.

Implementations:
- :func:`attend_blocks`: plain torch in float32 (GPU side: the D-windows; also a reference).
- :func:`block_partials`: plain torch, one partial per block of a ping-pong buffer holding
  blocks of many sequences.
- :func:`cpu_attend`: the compute region on the CPU, in place: by default the C++ kernel
  (:mod:`writescope.attention.cpu_kernel`, one call for the batch); with
  ``WRITESCOPE_CPU_ATTENTION=flash`` torch's CPU flash-attention op (which returns the lse), split
  along the keys so all threads have work (only the tails shorter than a chunk are copied).
"""

from __future__ import annotations

import torch

from writescope.attention import cpu_kernel
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

    By default (and where :func:`writescope.attention.cpu_kernel.usable`) the C++ kernel attends
    the whole batch in one call. With ``WRITESCOPE_CPU_ATTENTION=flash``, or inputs it does not
    take, GQA with equal k/v widths uses torch's ``_scaled_dot_product_flash_attention_for_cpu``.
    That op parallelises over batch x heads only, so each sequence's keys are viewed in place
    as a batch of chunks of exactly ``MIN_CPU_CHUNK`` keys (no copy, one call per sequence);
    the tails (the last ``n mod MIN_CPU_CHUNK`` keys) of all sequences with the same tail length
    are copied into one batch and attended by one call. Each call costs a parallel region of
    its own (not measured alone): a first version split n into chunks of n // (n // 512)
    keys plus a separate tail call per sequence, and an odd number of 256-token blocks made a
    16-sequence step 50% slower. All partials of all sequences are merged by lse in one pass.

    MLA (V = the first ``dv`` columns of the 576-wide latent K, a view of the same rows): the op
    needs equal K and V widths, so it is given the latent as both and the first ``dv`` output
    columns are kept; exact, with 12.5% more value work, at the op's speed (the plain-torch path
    read the latent at 6-7 GB/s on the H200 host; benchmarks/results/calibrate.md). Other
    shapes use :func:`attend_blocks` in chunks of ``FALLBACK_CHUNK`` keys.
    """
    B, Hkv, G, _ = q.shape
    if cpu_kernel.kernel_selected() and cpu_kernel.usable(q, kv):  # one call for the batch, merged (the default backend)
        return cpu_kernel.attend(q, kv, scale, dv=dv)
    kv = [None if x is None else _latent_as_values(*x) for x in kv]
    width_v = max([x[1].shape[-1] for x in kv if x is not None] or [dv])
    parts = [None if x is None else _cpu_partials(q[i], x[0], x[1], scale) for i, x in enumerate(kv)]
    tails = dict(_cpu_tails(q, kv, scale))
    counts = [(0 if p is None else p[0].shape[0]) + (i in tails) for i, p in enumerate(parts)]
    acc = torch.promote_types(q.dtype, torch.float32)
    width = max(counts + [1])
    # written in place, not zero-filled and concatenated: at 16 x 10K keys the fills and cats of
    # a first version cost 1.4-5.0 ms per step on the H200 host (benchmarks/results/scheduler.md)
    o = torch.empty(B, width, Hkv, G, width_v, dtype=acc)
    lse = torch.empty(B, width, Hkv, G, dtype=acc)
    for i, p in enumerate(parts):
        n = 0
        if p is not None:
            n = p[0].shape[0]
            o[i, :n], lse[i, :n] = p[0], p[1]
        if i in tails:
            o[i, n], lse[i, n] = tails[i][0][0], tails[i][1][0]
            n += 1
        if n < width:  # empty partials: weight 0, finite output
            o[i, n:] = 0
            lse[i, n:] = float("-inf")
    if width == 1:
        return o[:, 0, ..., :dv], lse[:, 0]
    o, lse = merge_stacked(o, lse, dim=1)
    return o[..., :dv], lse


def _latent_as_values(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, k)`` when ``v`` is the leading columns of ``k`` (MLA's latent), else ``(k, v)``."""
    if v.shape[-1] < k.shape[-1] and v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:-1] == k.shape[:-1]:
        return k, k
    return k, v


def _flash_ok(k, v) -> bool:
    return v.shape[-1] == k.shape[-1] and k.stride(-1) == 1 and v.stride(-1) == 1


def _cpu_partials(q, k, v, scale):
    """Unmerged partials of one sequence's whole chunks: ``(o [P, Hkv, G, dv], lse [P, Hkv, G])``,
    or None when it has no whole chunk (its keys are all tail)."""
    Hkv, n, dk = k.shape
    assert n >= 1, "cpu_attend needs at least one key per listed sequence"
    if not _flash_ok(k, v):
        parts = [
            attend_blocks(q[None], k[None, None, :, s : s + FALLBACK_CHUNK], v[None, None, :, s : s + FALLBACK_CHUNK], scale)
            for s in range(0, n, FALLBACK_CHUNK)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    c = MIN_CPU_CHUNK
    chunks = n // c
    if chunks == 0:
        return None
    kc = k.as_strided((chunks, Hkv, c, dk), (c * k.stride(1), k.stride(0), k.stride(1), 1), k.storage_offset())
    vc = v.as_strided((chunks, Hkv, c, dk), (c * v.stride(1), v.stride(0), v.stride(1), 1), v.storage_offset())
    return _cpu_flash(q.unsqueeze(0).expand(chunks, -1, -1, -1), kc, vc, scale=scale)[:2]  # [chunks, Hkv, G, dv], [chunks, Hkv, G]


def _cpu_tails(q, kv, scale):
    """``(i, (o [1, Hkv, G, dv], lse [1, Hkv, G]))`` for every sequence i whose key count is not
    a multiple of ``MIN_CPU_CHUNK``: tails of equal length are stacked (a copy of fewer than
    ``MIN_CPU_CHUNK`` keys each) and attended by one call."""
    c = MIN_CPU_CHUNK
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(kv):
        if x is not None and _flash_ok(*x) and x[0].shape[1] % c:
            groups.setdefault(x[0].shape[1] % c, []).append(i)
    for t, ids in groups.items():
        k = torch.stack([kv[i][0][:, -t:] for i in ids])  # [m, Hkv, t, dk]
        v = torch.stack([kv[i][1][:, -t:] for i in ids])
        o, lse = _cpu_flash(q[ids], k, v, scale=scale)[:2]
        for j, i in enumerate(ids):
            yield i, (o[j : j + 1], lse[j : j + 1])
