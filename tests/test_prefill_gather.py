"""The chunked prefill's read of a sequence's cached KV (kvcache/inplace.py ``_gather``): each
region crosses in one piece and the blocks are put in position order on the device. Checked
against a per-block reference (the old form: one copy per block) for every placement and odd
lengths, on the CPU (the regions are host tensors there too)."""

from __future__ import annotations

import pytest
import torch

from writescope import LLM
from writescope.scheduler.policies import COMPUTE

D = 16


def _reference(cache, sq, layer: int) -> torch.Tensor:
    """One block at a time, in position order, as the first form read them."""
    pieces = []
    for j in range(sq.placed[layer] // D):
        region, idx = sq.homes[j]
        blk = sq.compute[layer, :, :, idx * D : (idx + 1) * D] if region == COMPUTE else sq.load_block(layer, idx)
        pieces.append(blk.to(cache.device))
    pieces.append(sq.window[layer, :, :, : sq.win_len[layer]])
    return torch.cat(pieces, dim=2)


@pytest.mark.parametrize("policy", ["static:0.5", "static:0.3", "cpu", "gpu"])
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_gather_equals_the_block_by_block_read(policy, preset):
    _check_gather(LLM(preset, progress=False, policy=policy, window=D), policy)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["static:0.5", "cpu"])
def test_gather_on_cuda_reads_the_compute_rows_through_pinned_staging(policy):
    """On CUDA the compute rows cross through the prefill writer's pinned buffers (kvcache/
    inplace.py ``_read_compute``): the same tensor as the block-by-block read."""
    llm = LLM("tiny-deepseek-v2", device="cuda", dtype="bfloat16", progress=False, policy=policy, window=D)
    _check_gather(llm, policy)
    assert llm.cache._writer is not None and all(b.is_pinned() for b in llm.cache._writer._bufs)


def _check_gather(llm, policy: str) -> None:
    cache, lay = llm.cache, llm.config.kv_layout
    g = torch.Generator().manual_seed(7)
    lens = [1, 15, 16, 17, 4097]
    slots = [cache.allocate(n + 4, prompt_len=n) for n in lens]
    for slot, n in zip(slots, lens):
        for layer in range(llm.config.num_layers):
            for a in range(0, n, 1000):  # in chunks, as a chunked prefill writes
                e = min(n, a + 1000)
                k = torch.randn(e - a, lay.kv_heads, lay.k_dim, generator=g).to(cache.device, cache.spec.dtype)
                v = None if lay.shared_kv else torch.randn(e - a, lay.kv_heads, lay.v_dim, generator=g).to(cache.device, cache.spec.dtype)
                cache.write(slot, layer, k, v)
    regions = set()
    before = cache.prefill_readback_bytes
    for slot, n in zip(slots, lens):
        sq = cache.sequence(slot)
        regions |= {r for r, _ in sq.homes}
        for layer in (0, llm.config.num_layers - 1):
            got = cache._gather(sq, layer)
            assert got.shape[2] == n
            assert torch.equal(got, _reference(cache, sq, layer))
    # every placed block read counts once per read (two layers read per sequence, all placed alike)
    assert cache.prefill_readback_bytes - before == sum(
        2 * (cache.sequence(s).placed[0] // D) * cache.spec.block_bytes for s in slots)
    if policy.startswith("static"):
        assert len(regions) == 2  # both regions, interleaved
    for s in slots:
        cache.free(s)
