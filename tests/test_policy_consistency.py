"""benchmarks/policy_consistency.py's teacher-forced logit comparison (issue 6, run 6)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from writescope import LLM, SamplingParams

_spec = importlib.util.spec_from_file_location("policy_consistency", Path(__file__).parents[1] / "benchmarks" / "policy_consistency.py")
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)


def test_forced_tokens_give_the_reference_logits_under_every_policy():
    llm = LLM("tiny-qwen3-moe", dtype="fp32", progress=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, llm.config.vocab_size, (n,), generator=g).tolist() for n in (40, 17)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    ref_outs, ref_steps = pc.generate_forced(llm, prompts, params)
    assert len(ref_steps) == 5 and ref_steps[0].shape == (2, llm.config.vocab_size)
    forced = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]]  # not what greedy picks: the forced tokens are fed
    outs, steps = pc.generate_forced(llm, prompts, params, forced=forced)
    assert [o.token_ids for o in outs] == forced
    assert pc.compare_logits(steps[:1], ref_steps[:1])["max_abs_logit_diff"] == 0  # the same prefill
    assert pc.compare_logits(steps, ref_steps)["max_abs_logit_diff"] > 0.01  # other tokens, other logits
    ref = [o.token_ids for o in ref_outs]
    for policy in ("gpu", "cpu", "static:0.5"):
        llm.set_policy(policy, window=16)
        _, steps = pc.generate_forced(llm, prompts, params, forced=ref)
        cmp = pc.compare_logits(steps, ref_steps)
        assert cmp["max_abs_logit_diff"] < 1e-4 and cmp["ref_logit_range"] > 1, (policy, cmp)
    top = ref_steps[2][1].topk(2).values
    assert pc.margin(ref_steps, 1, 2) == (top[0] - top[1]).item() >= 0
    with pytest.raises(ValueError, match="every request to run every step"):  # the second request stops after 2 tokens
        pc.generate_forced(llm, prompts, [SamplingParams(max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=2, ignore_eos=True)], forced=ref)
    assert pc.engine.sample.__name__ == "sample" and pc.engine.sample.__module__ == "writescope.engine.sampling"  # restored
