"""writescope.kvcache.huge_pages: compute regions mapped for transparent huge pages give the same
cache contents and the same tokens as torch's allocator."""

from __future__ import annotations

import pytest
import torch

from writescope import LLM, SamplingParams
from writescope.kvcache.huge_pages import compute_empty, huge_pages_wanted, thp_mode


def test_compute_empty_is_a_writable_tensor_of_the_shape(monkeypatch):
    monkeypatch.setenv("WRITESCOPE_HUGE_PAGES", "on")
    assert huge_pages_wanted() and thp_mode() in ("always", "madvise", "never", "unknown")
    t = compute_empty((3, 1, 2, 4097, 5), torch.bfloat16)
    assert t.shape == (3, 1, 2, 4097, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    src = torch.randn(t.shape).bfloat16()
    t.copy_(src)
    assert torch.equal(t, src)
    assert compute_empty((0, 4), torch.float32).shape == (0, 4)
    monkeypatch.setenv("WRITESCOPE_HUGE_PAGES", "maybe")
    with pytest.raises(ValueError, match="WRITESCOPE_HUGE_PAGES='maybe'"):
        compute_empty((2,), torch.float32)


def test_huge_page_compute_regions_give_the_same_tokens(monkeypatch):
    """A split policy (half the KV in compute regions) decodes the same tokens with the regions
    in huge-page mappings as in torch's allocations."""
    prompts = [[(5 * i + 1) % 200 + 3 for i in range(90)], [(3 * i + 7) % 200 + 3 for i in range(40)]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("WRITESCOPE_HUGE_PAGES", mode)
        llm = LLM("tiny-deepseek-v2", policy="static:0.5", window=16, progress=False)
        out[mode] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        llm.cache.close()
    assert out["on"] == out["off"]
