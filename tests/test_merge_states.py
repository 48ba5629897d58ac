"""Tests of ``writescope.attention.merge.merge_states``: the exact log-sum-exp merge of partial
attentions over disjoint key sets.

The reference is built from first principles: random q, k, v; the keys are split into disjoint
sets; each set's softmax attention and log-sum-exp are computed in float64, and merging the
partials must reproduce plain attention over all keys.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from writescope.attention.merge import merge_states

NEG_INF = float("-inf")
# Tolerances: float64 partials agree with float64 full attention to summation-order rounding
# (~1e-15), checked at 1e-12; float32 partials carry ~6e-8 input rounding, checked at 1e-5.
TOL64 = dict(rtol=1e-12, atol=1e-12)
TOL32 = dict(rtol=1e-5, atol=1e-5)


def attend(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``[B, H, Dv]`` and natural-log lse ``[B, H]`` of scores ``[B, H, N]``
    over values ``[B, H, N, Dv]``; no keys gives the empty partial (0, -inf)."""
    if scores.shape[-1] == 0:
        return v.new_zeros(v.shape[0], v.shape[1], v.shape[-1]), scores.new_full(scores.shape[:-1], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("bhn,bhnd->bhd", torch.exp(scores - lse[..., None]), v), lse


def random_partials(batch, heads, dim, keys, parts, seed=0):
    """``parts`` float64 partial states over a random disjoint split of ``keys`` keys (some
    parts may get no keys: they are empty), and the float64 full attention over all keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, heads, keys, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, heads, keys, dim, generator=g, dtype=torch.float64)
    scores = torch.einsum("bhd,bhnd->bhn", q, k) * (2.0 / math.sqrt(dim))
    which = torch.randint(0, parts, (keys,), generator=g)  # key j belongs to partial which[j]
    partials = [attend(scores[..., which == p], v[:, :, which == p]) for p in range(parts)]
    return [o for o, _ in partials], [s for _, s in partials], attend(scores, v)


def cast(outs, lses, out_dtype, lse_dtype=torch.float32):
    return [o.to(out_dtype) for o in outs], [s.to(lse_dtype) for s in lses]


def check_close(result, expected, **tol):
    torch.testing.assert_close(result[0].double(), expected[0].double(), **tol)
    torch.testing.assert_close(result[1].double(), expected[1].double(), **tol)


# 1. merging real partials equals full attention
@pytest.mark.parametrize("parts", [1, 2, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_full_attention_float64_and_float32(parts, seed):
    outs, lses, full = random_partials(4, 3, 8, 40, parts, seed)
    check_close(merge_states(outs, lses), full, **TOL64)
    o32, l32 = cast(outs, lses, torch.float32)
    out, lse = merge_states(o32, l32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    check_close((out, lse), full, **TOL32)


# 2. empty partials
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_side_empty_gives_the_other_exactly(dtype):
    (o,), (s,), _ = random_partials(3, 2, 16, 10, 1)
    o, s = o.to(dtype), s.float()
    empty_o, empty_s = torch.zeros_like(o), torch.full_like(s, NEG_INF)
    for outs, lses in (([o, empty_o], [s, empty_s]), ([empty_o, o, empty_o], [empty_s, s, empty_s])):
        out, lse = merge_states(outs, lses)
        assert torch.equal(out, o) and torch.equal(lse, s)


@pytest.mark.parametrize("parts", [1, 2, 7])
def test_all_empty_gives_zero_and_neg_inf_without_nan(parts):
    out, lse = merge_states([torch.zeros(2, 3, 4)] * parts, [torch.full((2, 3), NEG_INF)] * parts)
    assert torch.equal(out, torch.zeros(2, 3, 4))
    assert torch.isneginf(lse).all() and lse.shape == (2, 3)


def test_some_rows_empty():
    (oa, ob), (la, lb), full = random_partials(6, 4, 8, 30, 2, seed=3)
    g = torch.Generator().manual_seed(7)
    empty_a, empty_b = torch.rand(6, 4, generator=g) < 0.4, torch.rand(6, 4, generator=g) < 0.4
    oa, la = oa.masked_fill(empty_a[..., None], 0), la.masked_fill(empty_a, NEG_INF)
    ob, lb = ob.masked_fill(empty_b[..., None], 0), lb.masked_fill(empty_b, NEG_INF)
    out, lse = merge_states([oa, ob], [la, lb])
    assert not out.isnan().any() and not lse.isnan().any()
    both, only_a, only_b = empty_a & empty_b, empty_a & ~empty_b, empty_b & ~empty_a
    neither = ~(empty_a | empty_b)
    assert both.any() and only_a.any() and only_b.any() and neither.any()  # the seed covers every case
    assert (out[both] == 0).all() and torch.isneginf(lse[both]).all()
    assert torch.equal(out[only_a], ob[only_a]) and torch.equal(lse[only_a], lb[only_a])
    assert torch.equal(out[only_b], oa[only_b]) and torch.equal(lse[only_b], la[only_b])
    check_close((out[neither], lse[neither]), (full[0][neither], full[1][neither]), **TOL64)


# 3. self-merge
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_self_merge_adds_ln2_and_keeps_output(dtype):
    (o,), (s,), _ = random_partials(3, 2, 16, 10, 1)
    o, s = o.to(dtype), s.to(torch.float64 if dtype == torch.float64 else torch.float32)
    out, lse = merge_states([o, o], [s, s])
    assert torch.equal(out, o)
    torch.testing.assert_close(lse.double(), s.double() + math.log(2), rtol=1e-6, atol=1e-6)


# 4. associativity
def left_fold(outs, lses):
    acc = (outs[0], lses[0])
    for o, s in zip(outs[1:], lses[1:]):
        acc = merge_states([acc[0], o], [acc[1], s])
    return acc


def tree(outs, lses):
    if len(outs) == 1:
        return outs[0], lses[0]
    mid = len(outs) // 2
    (o1, s1), (o2, s2) = tree(outs[:mid], lses[:mid]), tree(outs[mid:], lses[mid:])
    return merge_states([o1, o2], [s1, s2])


@pytest.mark.parametrize("parts", [1, 2, 3, 17, 64])
def test_associativity(parts):
    outs, lses, full = random_partials(2, 3, 8, 3 * parts, parts, seed=parts)
    at_once = merge_states(outs, lses)
    check_close(at_once, full, **TOL64)
    check_close(left_fold(outs, lses), at_once, **TOL64)
    check_close(tree(outs, lses), at_once, **TOL64)


# 5. non-contiguous inputs
def test_non_contiguous_inputs_match_contiguous_copies():
    g = torch.Generator().manual_seed(0)
    b, h, d = 5, 3, 8
    outs = [
        torch.randn(d, h, b, generator=g).permute(2, 1, 0),  # transposed
        torch.randn(b, h, 2 * d, generator=g)[..., ::2],  # strided last dim
        torch.randn(b + 2, h + 1, d, generator=g)[1:-1, 1:],  # sliced
    ]
    lses = [torch.randn(h, b, generator=g).t(), torch.randn(b, 2 * h, generator=g)[:, ::2], torch.randn(b + 1, h, generator=g)[1:]]
    assert not any(o.is_contiguous() for o in outs) and not all(s.is_contiguous() for s in lses)
    out, lse = merge_states(outs, lses)
    ref_out, ref_lse = merge_states([o.contiguous() for o in outs], [s.contiguous() for s in lses])
    # same arithmetic on the same values; allow a few float32 ulps for vectorised vs scalar exp
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)


# 6. half-precision outputs with float32 lse
# Tolerances: bf16 has 8 significant bits (rounding ~4e-3 on inputs and again on the result),
# checked at 1e-2; fp16 has 11 bits (~5e-4 twice), checked at 2e-3.
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_precision_outputs(dtype, tol):
    outs, lses, full = random_partials(4, 3, 64, 50, 4, seed=5)
    out, lse = merge_states(*cast(outs, lses, dtype))
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), full[0], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), full[1], **TOL32)


# 7. errors
def test_errors():
    o, s = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    bad = s.clone()
    bad[1, 2] = float("inf")
    with pytest.raises(ValueError, match=r"\+inf or NaN"):
        merge_states([o, o], [s, bad])
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"\+inf or NaN"):
        merge_states([o, o], [s, bad])
    with pytest.raises(ValueError, match=r"\+inf or NaN"):
        merge_states([o], [bad])
    with pytest.raises(ValueError, match="at least one partial"):
        merge_states([], [])
    with pytest.raises(ValueError, match="2 outputs, 1 lses"):
        merge_states([o, o], [s])
    for o2, s2 in ((o, torch.zeros(2, 4)), (torch.zeros(2, 4, 4), s), (torch.zeros(2, 3, 5), s), (torch.zeros(2, 3), s)):
        with pytest.raises(ValueError, match="shapes disagree"):
            merge_states([o, o2], [s, s2])


# 8. odd sizes and a property test
@pytest.mark.parametrize("batch", [1, 15, 16, 17])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("dim", [1, 64, 576])
def test_odd_sizes(batch, heads, dim):
    outs, lses, full = random_partials(batch, heads, dim, 12, 3, seed=batch * heads + dim)
    check_close(merge_states(outs, lses), full, **TOL64)
    check_close(merge_states(*cast(outs, lses, torch.float32)), full, **TOL32)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 5), heads=st.integers(1, 4), dim=st.integers(1, 16),
    keys=st.integers(1, 24), parts=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
)
def test_property_matches_full_attention(batch, heads, dim, keys, parts, seed):
    outs, lses, full = random_partials(batch, heads, dim, keys, parts, seed)
    check_close(merge_states(outs, lses), full, **TOL64)
    check_close(merge_states(*cast(outs, lses, torch.float32)), full, **TOL32)


# 9. large lse magnitudes
@pytest.mark.parametrize("shift", [1e4, -1e4, 3e4])
def test_large_lse_does_not_overflow(shift):
    # Shifting every score by c shifts every lse by c and leaves outputs unchanged; exp(1e4)
    # overflows float32, so only a max-shifted merge survives. The float32 lse at 1e4 has an ulp
    # of ~1e-3: the reference is the float64 merge formula of the exact float32 inputs, lse
    # checked to 2e-3 absolute (two ulps), outputs to 1e-5.
    outs, lses, _ = random_partials(3, 2, 8, 20, 4, seed=11)
    o32, l32 = cast(outs, [s + shift for s in lses], torch.float32)
    out, lse = merge_states(o32, l32)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_lse = torch.logsumexp(torch.stack(l32).double(), dim=0)
    w = torch.exp(torch.stack(l32).double() - ref_lse)
    ref_out = sum(wk[..., None] * ok.double() for wk, ok in zip(w, o32))
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=2e-3)
    torch.testing.assert_close(out.double(), ref_out, **TOL32)
    # a partial 2e4 nats lighter weighs exactly nothing
    far = merge_states([o32[0], o32[1]], [l32[0], l32[1] - 2e4])
    assert torch.equal(far[0], o32[0]) and torch.equal(far[1], l32[0])


def test_lse_dtype_promotes_over_all_partials():
    """A float64 lse anywhere (not only first) makes the merge run and return in float64."""
    o = torch.randn(2, 3, 4, dtype=torch.float64)
    lo, hi = torch.zeros(2, 3), torch.full((2, 3), 1e-9, dtype=torch.float64)
    out, lse = merge_states([o, o], [lo, hi])
    assert lse.dtype == torch.float64
    assert (lse - math.log(2)).abs().max().item() < 1e-9


def test_single_partial_returns_a_copy():
    o, s = torch.randn(2, 3, 4), torch.zeros(2, 3)
    out, lse = merge_states([o], [s])
    out += 1
    assert not torch.equal(out, o)
