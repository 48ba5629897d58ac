"""``cpu_attend`` with torch's flash op (``WRITESCOPE_CPU_ATTENTION=flash``): the compute-region CPU attention (whole chunks in place, tails batched) against
float64 attention. Tolerance: 1e-5 relative for float32 inputs, bf16 rounding (2e-2) for bf16."""

from __future__ import annotations

import pytest
import torch

import writescope.attention.partial as partial
from writescope.attention.partial import cpu_attend


@pytest.fixture(autouse=True)
def flash_backend(monkeypatch):
    """These tests are of torch's flash-op backend (the C++ kernel's are in test_cpu_kernel.py)."""
    monkeypatch.setenv("WRITESCOPE_CPU_ATTENTION", "flash")


def reference(q, k, v, scale):
    """q [Hkv, G, dk], k [Hkv, n, dk], v [Hkv, n, dv] -> (o [Hkv, G, dv], lse [Hkv, G]) in float64."""
    s = torch.einsum("hgd,hnd->hgn", q.double(), k.double()) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("hgn,hnd->hgd", torch.softmax(s, dim=-1), v.double()), lse


def assert_matches_reference(q, kv, o, lse, scale, tol):
    """Each sequence's (o, lse) equals float64 attention; empty ones are (0, -inf)."""
    for i, x in enumerate(kv):
        if x is None:
            assert torch.all(o[i] == 0) and torch.all(lse[i] == float("-inf"))
            continue
        ro, rl = reference(q[i], x[0], x[1], scale)
        torch.testing.assert_close(o[i].double(), ro, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[i].double(), rl, rtol=tol, atol=tol)


def regions(lengths, Hkv, dk, dtype, gen, cap=None):
    """Per sequence a [2, Hkv, cap, dk] region (per-head rows, as the compute region) and its
    first n keys as views; None where the length is 0."""
    out = []
    for n in lengths:
        if n == 0:
            out.append(None)
            continue
        reg = torch.randn(2, Hkv, cap or n + 7, dk, generator=gen).to(dtype)
        out.append((reg[0, :, :n], reg[1, :, :n]))
    return out


@pytest.mark.parametrize("chunk", [512, 16])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_float64_on_ragged_lengths(chunk, dtype, tol, monkeypatch):
    monkeypatch.setattr(partial, "MIN_CPU_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    # odd sizes; two equal tails (1280 and 768 leave 256 for chunk 512) share one call; 0 = no keys
    lengths = [1, 15, 16, 17, 0, 511, 512, 513, 1280, 768, 4097]
    Hkv, G, dk = 2, 4, 32
    kv = regions(lengths, Hkv, dk, dtype, gen)
    q = torch.randn(len(lengths), Hkv, G, dk, generator=gen).to(dtype)
    o, lse = cpu_attend(q, kv, dk**-0.5, dk)
    assert o.shape == (len(lengths), Hkv, G, dk) and lse.shape == (len(lengths), Hkv, G)
    assert_matches_reference(q, kv, o, lse, dk**-0.5, tol)


def test_whole_chunks_read_in_place_and_tails_in_one_call(monkeypatch):
    """The op is called once per sequence with whole chunks (views of the region, no copy) and
    once for all tails of one length."""
    monkeypatch.setenv("WRITESCOPE_CPU_ATTENTION", "flash")
    calls = []
    real = partial._cpu_flash

    def spy(q, k, v, **kw):
        calls.append((tuple(k.shape), k.is_contiguous()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(partial, "_cpu_flash", spy)
    gen = torch.Generator().manual_seed(1)
    lengths = [1024, 1280, 768, 256]  # chunks 2, 2, 1, 0; tails 0, 256, 256, 256
    kv = regions(lengths, 2, 16, torch.float32, gen, cap=2048)
    q = torch.randn(4, 2, 2, 16, generator=gen)
    cpu_attend(q, kv, 0.25, 16)
    whole = [c for c in calls if c[0][2] == 512]
    tails = [c for c in calls if c[0][2] != 512]
    assert [c[0][0] for c in whole] == [2, 2, 1] and not any(c[1] for c in whole)  # strided views of the regions
    assert len(tails) == 1 and tails[0][0] == (3, 2, 256, 16)


@pytest.mark.parametrize("chunk", [512, 16])
def test_mla_latent_through_the_flash_op(chunk, monkeypatch):
    """MLA: V is the first dv columns of the latent K (a view); the op is given the latent as
    both and the first dv output columns kept. Exact against float64; the op is called (not the
    plain-torch fallback)."""
    monkeypatch.setattr(partial, "MIN_CPU_CHUNK", chunk)
    monkeypatch.setenv("WRITESCOPE_CPU_ATTENTION", "flash")
    calls = []
    real = partial._cpu_flash
    monkeypatch.setattr(partial, "_cpu_flash", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    gen = torch.Generator().manual_seed(5)
    dk, dv, G = 40, 32, 16
    lengths = [1, 17, 0, 513, 1100]
    kv = []
    for n in lengths:
        lat = torch.randn(1, n + 3, dk, generator=gen)[:, :n] if n else None  # [1 head, n, dk] rows of a region
        kv.append(None if lat is None else (lat, lat[..., :dv]))
    q = torch.randn(len(lengths), 1, G, dk, generator=gen)
    o, lse = cpu_attend(q, kv, dk**-0.5, dv)
    assert o.shape == (len(lengths), 1, G, dv) and calls
    for i, x in enumerate(kv):
        if x is None:
            assert torch.all(lse[i] == float("-inf"))
            continue
        ro, rl = reference(q[i], x[0], x[1], dk**-0.5)
        torch.testing.assert_close(o[i].double(), ro, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[i].double(), rl, rtol=1e-5, atol=1e-5)


def test_cpu_attention_is_checked_and_named_before_the_weights_load(monkeypatch):
    from writescope import LLM
    from writescope.attention import cpu_kernel

    monkeypatch.setenv("WRITESCOPE_CPU_ATTENTION", "kernal")
    with pytest.raises(ValueError, match=r"WRITESCOPE_CPU_ATTENTION='kernal': use 'kernel' .* or 'flash'"):
        LLM("tiny-qwen3-moe", progress=False, policy="static:0.5")
    monkeypatch.setenv("WRITESCOPE_CPU_ATTENTION", "flash")
    assert cpu_kernel.prepare(progress=False) == "torch's flash op"
    monkeypatch.setenv("WRITESCOPE_CPU_ATTENTION", "kernel")
    monkeypatch.setenv("WRITESCOPE_CPU_ISA", "avx-9000")
    with pytest.raises(ValueError, match=r"WRITESCOPE_CPU_ISA='avx-9000'"):
        LLM("tiny-qwen3-moe", progress=False, policy="static:0.5")
