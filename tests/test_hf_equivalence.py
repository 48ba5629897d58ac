"""Our three architectures against Hugging Face transformers' eager implementation.

Checkpoints are written by transformers' own ``save_pretrained`` and loaded by both. The batch
is ragged (prompt lengths 1, 17, 9 and 33, prefilled in one pass) and is then decoded together
for 8 greedy steps through our KV cache.
"""

import pytest
import torch

from helpers import TINY, hf_logits, hf_reference_checkpoint, load_hf, load_ours, ours_prefill_then_decode

LENGTHS = [1, 17, 9, 33]
STEPS = 8
FP32_TOL = 1e-4


@pytest.fixture(scope="module", params=TINY)
def hf_ckpt(request, tmp_path_factory):
    return request.param, hf_reference_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@torch.no_grad()
def _greedy_hf(hf, prompt: list[int], steps: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(prompt) :].tolist()


def test_fp32_prefill_and_decode_match_transformers(hf_ckpt):
    name, path = hf_ckpt
    hf, ours = load_hf(path, torch.float32), load_ours(path, torch.float32)
    prompts = _prompts(ours.config.vocab_size)
    conts = [_greedy_hf(hf, p, STEPS) for p in prompts]
    prefill, decode = ours_prefill_then_decode(ours, prompts, conts)
    for p, c, pre, dec in zip(prompts, conts, prefill, decode):
        ref = hf_logits(hf, p + c)  # [len + steps, vocab]
        assert ref.std() > 0.3, "reference logits are degenerate; the test would not discriminate"
        torch.testing.assert_close(pre, ref[: len(p)], atol=FP32_TOL, rtol=0)
        # decode step s consumes token c[s] at position len(p) + s
        torch.testing.assert_close(dec, ref[len(p) : len(p) + STEPS], atol=FP32_TOL, rtol=0)
        # our greedy choice agrees with transformers' at every step
        assert dec.argmax(-1)[:-1].tolist() == c[1:], name


def test_fp32_engine_greedy_tokens_match_transformers(hf_ckpt):
    from writescope import LLM, SamplingParams

    name, path = hf_ckpt
    hf = load_hf(path, torch.float32)
    llm = LLM(str(path), dtype="fp32", device="cpu", progress=False)
    prompts = _prompts(llm.config.vocab_size, seed=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=STEPS, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == _greedy_hf(hf, p, STEPS), name


def test_bf16_error_within_twice_transformers_bf16_error(hf_ckpt):
    """bf16 has no exact answer, so the tolerance is relative to transformers itself: against the
    fp32 reference, our bf16 logits may err at most 2x what transformers' bf16 logits err (plus
    a small floor for lucky HF roundings), the criterion of STYLE.md for same-dtype kernels."""
    name, path = hf_ckpt
    ref_model = load_hf(path, torch.float32)
    hf16, ours16 = load_hf(path, torch.bfloat16), load_ours(path, torch.bfloat16)
    prompts = _prompts(ours16.config.vocab_size, seed=3)
    conts = [_greedy_hf(ref_model, p, STEPS) for p in prompts]
    prefill, decode = ours_prefill_then_decode(ours16, prompts, conts)
    for p, c, pre, dec in zip(prompts, conts, prefill, decode):
        ref = hf_logits(ref_model, p + c)
        ours_all = torch.cat([pre, dec[:-1]])  # positions 0 .. len + steps - 2
        hf_all = hf_logits(hf16, p + c)[: len(ours_all)]
        ref = ref[: len(ours_all)]
        err_ours = (ours_all - ref).norm() / ref.norm()
        err_hf = (hf_all - ref).norm() / ref.norm()
        assert torch.isfinite(ours_all).all()
        assert err_ours <= 2 * err_hf + 5e-3, f"{name}: ours {err_ours:.2e} vs transformers bf16 {err_hf:.2e}"
        assert err_ours < 0.1, f"{name}: bf16 relative error {err_ours:.2e}"
