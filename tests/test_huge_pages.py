"""writescope.kvcache.huge_pages: compute regions mapped for transparent huge pages give the same
cache contents and the same tokens as torch's allocator."""

from __future__ import annotations

import pytest
import torch

from writescope import LLM, SamplingParams
from writescope.kvcache.huge_pages import compute_empty, huge_pages_wanted, thp_mode


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


def test_compute_empty_is_a_writable_tensor_of_the_shape(monkeypatch):
    monkeypatch.setenv("WRITESCOPE_HUGE_PAGES", "on")
    assert huge_pages_wanted() and thp_mode() in ("always", "madvise", "never", "unknown")
    t = compute_empty((3, 1, 2, 4097, 5), torch.bfloat16)
    assert t.shape == (3, 1, 2, 4097, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    if thp_mode() in ("always", "madvise"):  # the mapping was advised: the kernel marks it "hg"
        assert "hg" in _vm_flags(t.data_ptr())
    monkeypatch.setenv("WRITESCOPE_HUGE_PAGES", "off")
    assert "hg" not in _vm_flags(compute_empty((1 << 20,), torch.float32).data_ptr())
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
