"""The plain-torch prefill attention (``writescope.attention.reference``) and its query chunks."""

from __future__ import annotations

import torch

import writescope.attention.reference as ref


def _float64_attention(q, k, v, context_len, scale):
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    pos_q = torch.arange(context_len, context_len + n)[:, None]
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


def test_query_chunk_bounds_the_scores():
    assert ref.query_chunk(16, 1) == ref.QUERY_CHUNK
    assert ref.query_chunk(16, 32768) == ref.SCORE_BYTES // (5 * 16 * 32768)  # 102 queries at 32K keys
    assert ref.query_chunk(10**6, 10**6) == 1
    assert ref.query_chunk(32, 32768, k_dim=128) == ref.QUERY_CHUNK  # fused kernels: no scores held


def test_small_score_bound_gives_the_same_attention(monkeypatch):
    """Chunks of 1..3 queries (odd sizes, a context before them, MLA-like shapes: 1 KV head,
    values narrower than keys) equal the float64 reference."""
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(ref, "FUSED_MAX_DIM", 4)  # the bound applies to these small widths too
    for n, ctx, hq, hkv, dk, dv in ((17, 0, 4, 1, 24, 16), (15, 33, 8, 2, 16, 16), (1, 4097, 2, 1, 8, 8)):
        q = torch.randn(n, hq, dk, generator=g)
        k = torch.randn(ctx + n, hkv, dk, generator=g)
        v = torch.randn(ctx + n, hkv, dv, generator=g)
        want = _float64_attention(q, k, v, ctx, dk**-0.5)
        for score_bytes in (5 * hq * (ctx + n), 15 * hq * (ctx + n), ref.SCORE_BYTES):
            monkeypatch.setattr(ref, "SCORE_BYTES", score_bytes)
            got = ref.attend_sequence(q, k, v, ctx, dk**-0.5)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
