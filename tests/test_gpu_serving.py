"""What a server needs from the engine on CUDA (issue 18): memory that stays flat over many short
requests (device memory, page-locked host memory, the pinned pool's idle buffers), and logprobs
sampled on the device equal to those sampled on the host.

Run on the GPU machine: ``python -m pytest -m gpu tests/test_gpu_serving.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from helpers import run_short_requests, short_request_engine

from writescope import SamplingParams
from writescope.engine.sampling import sample_with_logprobs
from writescope.kvcache import pinned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MiB = 2**20


@pytest.mark.parametrize("policy", ["gpu", "static:0.5"])
def test_a_thousand_requests_leave_device_and_pinned_memory_flat(policy, monkeypatch):
    """1,000 short requests one after another (prompts of 4-12 tokens, 1-6 new tokens, windows of
    4 tokens so blocks are evicted to the host) after 100 unmeasured ones: device memory allocated
    and reserved stay within 2 MiB, no host memory is registered after the warm-up (the pool lends
    the freed buffers again), its idle buffers stay under its cap, and every slot is freed."""
    monkeypatch.setenv("WRITESCOPE_PINNED_POOL", "64MiB")
    pinned.POOL.release_idle()
    llm, core = short_request_engine("cuda", policy)
    run_short_requests(core, 100)
    gc.collect()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    registered = pinned.STATS["register_bytes"]
    reused = pinned.STATS["reused"]
    run_short_requests(core, 1000)
    gc.collect()
    torch.cuda.synchronize()
    assert llm.cache.active_slots == [] and not core.has_work() and not core.scheduler.active
    assert llm.cache.evicted_blocks > 0
    assert torch.cuda.memory_allocated() - allocated < 2 * MiB
    assert torch.cuda.memory_reserved() - reserved < 2 * MiB
    assert pinned.STATS["register_bytes"] == registered  # every request's pinned buffers lent again
    assert pinned.STATS["reused"] - reused > 0
    assert pinned.POOL.idle_bytes <= 64 * MiB
    llm.set_policy("resident")
    pinned.POOL.release_idle()


def test_sample_with_logprobs_on_cuda_matches_the_host():
    """Greedy sampling with logprobs on the device: the same tokens, logprobs and top lists as
    the same call on host tensors (float32 softmax on both); a row without logprobs gets None;
    a seeded sampled row's logprob is that of the token it drew."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4097, generator=gen) * 4
    params = [SamplingParams(logprobs=5), SamplingParams(), SamplingParams(logprobs=0),
              SamplingParams(temperature=0.8, seed=3, logprobs=2), SamplingParams(logprobs=20)]

    def gens(device):
        return [None, None, None, torch.Generator(device=device).manual_seed(3), None]

    host_ids, host_lps = sample_with_logprobs(logits, params, gens("cpu"))
    dev_ids, dev_lps = sample_with_logprobs(logits.cuda(), params, gens("cuda"))
    greedy = [0, 1, 2, 4]
    assert [dev_ids[i] for i in greedy] == [host_ids[i] for i in greedy] == logits[greedy].argmax(-1).tolist()
    assert dev_lps[1] is None and host_lps[1] is None
    for i in greedy:
        if i == 1:
            continue
        d, h = dev_lps[i], host_lps[i]
        assert d.token_id == h.token_id and d.logprob == pytest.approx(h.logprob, abs=1e-5)
        assert [t for t, _ in d.top] == [t for t, _ in h.top] and len(d.top) == params[i].logprobs
        assert [v for _, v in d.top] == pytest.approx([v for _, v in h.top], abs=1e-5)
    sampled = dev_lps[3]  # a seeded draw on the device: its own generator, so only its logprob is checked
    assert sampled.token_id == dev_ids[3] and len(sampled.top) == 2
    ref = torch.log_softmax(logits[3].double(), -1)
    assert sampled.logprob == pytest.approx(ref[dev_ids[3]].item(), abs=1e-4)
