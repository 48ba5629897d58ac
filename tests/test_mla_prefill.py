"""MLA prefill in its two exact forms (``WRITESCOPE_MLA_PREFILL``): absorbed (default) and
expanded. Expanded against transformers' DeepSeek-V2 (which expands every step), and both forms
giving the same logits and tokens through every cache, with chunked prefill reading context back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import hf_logits, hf_reference_checkpoint, load_hf, load_ours, ours_prefill_then_decode
from writescope import LLM, SamplingParams
from writescope.layers.attention import mla_prefill_mode

FP32_TOL = 1e-4


def test_expanded_prefill_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_MLA_PREFILL", "expanded")
    path = hf_reference_checkpoint("tiny-deepseek-v2", tmp_path)
    hf, ours = load_hf(path, torch.float32), load_ours(path, torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, ours.config.vocab_size, (n,), generator=g).tolist() for n in (1, 17, 33)]
    conts = [[5, 6, 7, 8] for _ in prompts]
    prefill, decode = ours_prefill_then_decode(ours, prompts, conts)
    for p, c, pre, dec in zip(prompts, conts, prefill, decode):
        ref = hf_logits(hf, p + c)
        assert ref.std() > 0.3
        torch.testing.assert_close(pre, ref[: len(p)], atol=FP32_TOL, rtol=0)
        torch.testing.assert_close(dec, ref[len(p) : len(p) + len(c)], atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("policy", ["resident", "static:0.5", "cpu"])
def test_both_forms_give_the_same_tokens_through_every_cache(monkeypatch, policy):
    """Ragged prompts, chunked prefill (later chunks attend cached context read back from the
    regions), 6 greedy steps: identical tokens, and the expanded form really used its SDPA
    shape (per-head keys nope + rope wide, no grouped query call)."""
    prompts = [list(range(3, 3 + n)) for n in (1, 47, 130)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM("tiny-deepseek-v2", dtype="fp32", progress=False, prefill_chunk_tokens=64)
    if policy != "resident":
        llm.set_policy(policy, window=16)
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(((q.shape[1], k.shape[1], k.shape[-1], v.shape[-1]), q.shape[2]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setenv("WRITESCOPE_MLA_PREFILL", "expanded")
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == ref
    a = llm.config.attention
    expanded = (a.q_heads, a.q_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim)
    assert any(shape == expanded for shape, _ in calls)
    assert all(shape == expanded for shape, rows in calls if rows > 1)  # resident decodes through SDPA too (one row)


def test_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv("WRITESCOPE_MLA_PREFILL", "fast")
    with pytest.raises(ValueError, match="WRITESCOPE_MLA_PREFILL='fast'"):
        mla_prefill_mode()
