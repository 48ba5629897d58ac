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
    assert ref.query_chunk(16, 32768) == ref.SCORE_BYTES // (ref.BYTES_PER_SCORE * 16 * 32768)  # 102 queries at 32K keys
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
        for score_bytes in (ref.BYTES_PER_SCORE * hq * (ctx + n), 3 * ref.BYTES_PER_SCORE * hq * (ctx + n), ref.SCORE_BYTES):
            monkeypatch.setattr(ref, "SCORE_BYTES", score_bytes)
            got = ref.attend_sequence(q, k, v, ctx, dk**-0.5)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_wide_single_head_keys_fold_heads_and_respect_the_bound(monkeypatch):
    """For one shared KV head wider than the fused kernels take (MLA's latent): every SDPA call
    gets the heads as query rows of that one head (no per-head copy of the keys, no enable_gqa),
    and no call's scores pass the bound. Narrow heads keep the grouped call and whole chunks."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), kw.get("enable_gqa", False)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    n, hq = 300, 4
    monkeypatch.setattr(ref, "SCORE_BYTES", ref.BYTES_PER_SCORE * hq * n * 7)  # ~7 queries per call
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, hq, 300, generator=g)  # 300 > FUSED_MAX_DIM
    k = torch.randn(n, 1, 300, generator=g)
    v = torch.randn(n, 1, 256, generator=g)
    ref.attend_sequence(q, k, v, 0, 0.05)
    assert len(calls) > n // 7 - 1
    for qs, ks, gqa in calls:
        assert qs[:2] == (1, 1) and ks[1] == 1 and not gqa, (qs, ks, gqa)
        assert ref.BYTES_PER_SCORE * qs[2] * ks[2] <= ref.SCORE_BYTES  # q rows = heads x queries
    calls.clear()
    ref.attend_sequence(q[..., :64], k[..., :64], v[..., :64], 0, 0.05)  # fused width: one grouped call
    assert calls == [((1, hq, n, 64), (1, 1, n, 64), True)]
