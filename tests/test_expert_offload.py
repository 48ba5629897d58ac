"""Routed experts in host memory computed on the CPU give the all-device result."""

from __future__ import annotations

import pytest
import torch

from writescope import LLM
from writescope.attention.metadata import ForwardBatch
from writescope.kvcache.contiguous import ContiguousKVCache
from writescope.moe.block import SparseMoeBlock


def _logits(llm, ids):
    cache = ContiguousKVCache(llm.config.kv_layout, llm.config.num_layers, llm.dtype, "cpu")
    slot = cache.allocate(len(ids))
    with torch.no_grad():
        return llm.model(torch.tensor(ids), ForwardBatch.build([slot], [len(ids)], [0], "cpu"), cache, all_logits=True)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_offloaded_experts_give_the_same_logits(preset, fraction):
    llm = LLM(preset, progress=False)
    ids = torch.randint(3, llm.config.vocab_size, (97,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _logits(llm, ids)
    blocks = [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]
    g = torch.Generator().manual_seed(1)
    for b in blocks:
        E = b.cfg.num_experts
        b.offload_experts(torch.randperm(E, generator=g)[: int(fraction * E)].tolist())
        assert all(next(b.experts[e].parameters()).device.type == "cpu" for e in b.host_experts)
    assert sum(len(b.host_experts) for b in blocks) == sum(int(fraction * b.cfg.num_experts) for b in blocks)
    # summation order changes (host experts are added last): fp32 rounding only
    torch.testing.assert_close(_logits(llm, ids), ref, atol=1e-5, rtol=1e-5)


def test_bad_expert_id():
    llm = LLM("tiny-qwen3-moe", progress=False)
    block = next(m for m in llm.model.modules() if isinstance(m, SparseMoeBlock))
    E = block.cfg.num_experts
    with pytest.raises(ValueError, match=rf"outside \[0, {E}\)"):
        block.offload_experts([3, E])
    assert block.host_experts == frozenset()
