"""Routed experts as grouped GEMMs (``writescope.moe.grouped``) against the per-expert loop.
Tolerances: fp32 1e-5 relative (same products, another summation order); bf16 2e-2."""

from __future__ import annotations

import pytest
import torch

import writescope.moe.grouped as grouped
from writescope import LLM
from writescope.moe.block import SparseMoeBlock


def _blocks(llm):
    return [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.fixture(scope="module")
def llms():
    return {p: LLM(p, progress=False) for p in ("tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2")}


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2"])
@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 257])
@pytest.mark.parametrize("host_fraction", [0.0, 0.5])
def test_grouped_equals_the_loop(llms, preset, tokens, host_fraction):
    llm = llms[preset]
    assert llm.load_info["grouped_experts"]  # torch 2.13 has a CPU grouped GEMM: CI runs this path
    block = _blocks(llm)[0]
    E = block.cfg.num_experts
    g = torch.Generator().manual_seed(tokens)
    block.offload_experts(torch.randperm(E, generator=g)[: int(host_fraction * E)].tolist())
    x = torch.randn(tokens, block.gate.weight.shape[1], generator=g)
    try:
        with torch.no_grad():
            got = block(x)
            assert block.packed is not None
            block.grouped, block.packed = False, None
            ref = block(x)
    finally:  # the module-scoped model goes back to all experts on the device, grouped
        block.grouped = True
        block.offload_experts([])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bf16_grouped_within_rounding():
    llm = LLM("tiny-qwen3-moe", dtype="bf16", progress=False)
    block = _blocks(llm)[1]
    x = torch.randn(33, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        got = block(x)
        block.grouped, block.packed = False, None
        ref = block(x)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_packing_does_not_copy_the_experts(llms):
    block = _blocks(llms["tiny-mixtral"])[0]
    block.offload_experts([])
    assert block.pack()
    p = block.packed
    lo, hi = p.w13.data_ptr(), p.w13.data_ptr() + p.w13.numel() * p.w13.element_size()
    gate, up, down = block.cfg.expert_names
    for e in range(block.cfg.num_experts):
        assert lo <= getattr(block.experts[e], gate).weight.data_ptr() < hi
        assert lo <= getattr(block.experts[e], up).weight.data_ptr() < hi
        assert getattr(block.experts[e], down).weight.data_ptr() == p.w2[e].data_ptr()


def test_packing_frees_the_original_weights():
    """Once packed, the experts' original tensors are garbage: nothing (an autograd graph of
    the packing, the model, the loader) keeps them. On the H200 a graph did: DeepSeek-V2-Lite
    held 56 GiB of device memory for 29 GiB of weights under a 32 GiB budget."""
    import gc
    import weakref

    from writescope.engine.model_loader import load_model

    _, net, _, _ = load_model("tiny-deepseek-v2", True, torch.float32, torch.device("cpu"), progress=False)
    block = [m for m in net.modules() if isinstance(m, SparseMoeBlock)][0]
    olds = [weakref.ref(getattr(block.experts[e], n).weight) for e in range(block.cfg.num_experts) for n in block.cfg.expert_names]
    assert block.pack()
    gc.collect()
    assert not [r for r in olds if r() is not None]


def test_packing_frees_each_experts_weights_before_the_next_is_copied(monkeypatch):
    """Memory grows by about one expert while a block packs, not by its experts twice over (a
    list of concatenations and their stack: 3 GiB above Qwen3-30B-A3B's float32 weights, past what
    the memory check before a build counts): when an expert's weights are copied into the pack,
    the earlier experts' originals are gone."""
    import weakref

    from writescope.engine.model_loader import load_model

    _, net, _, _ = load_model("tiny-qwen3-moe", True, torch.float32, torch.device("cpu"), progress=False)
    block = [m for m in net.modules() if isinstance(m, SparseMoeBlock)][0]
    names, E = block.cfg.expert_names, block.cfg.num_experts
    olds = [weakref.ref(getattr(block.experts[e], n).weight) for e in range(E) for n in names]
    want = {getattr(block.experts[e], n).weight.detach().clone(): (e, n) for e in range(E) for n in names}
    alive_at_copy = []
    real_copy = torch.Tensor.copy_

    def spy(self, src, *a, **k):
        alive_at_copy.append(sum(r() is not None for r in olds))
        return real_copy(self, src, *a, **k)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    assert block.pack()
    monkeypatch.undo()
    assert len(alive_at_copy) == 3 * E  # each expert's three weights copied in, one by one
    assert all(alive <= 3 * E - 3 * (c // 3) for c, alive in enumerate(alive_at_copy))  # expert c // 3's and later ones only
    for w, (e, n) in want.items():  # the same values, now views of the pack
        torch.testing.assert_close(getattr(block.experts[e], n).weight, w, rtol=0, atol=0)


def test_row_chunks_equal_one_pass(llms, monkeypatch):
    block = _blocks(llms["tiny-qwen3-moe"])[0]
    x = torch.randn(29, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        one = block(x)
        monkeypatch.setattr(grouped, "ROW_CHUNK", 5)  # 29 tokens x top-4 = 116 rows: 24 chunks, groups cut across them
        chunked = block(x)
    torch.testing.assert_close(chunked, one, rtol=1e-6, atol=1e-6)


def test_offload_after_packing_frees_the_old_pack_and_stale_packs_are_dropped(llms):
    block = _blocks(llms["tiny-mixtral"])[1]
    gate = block.cfg.expert_names[0]
    block.offload_experts([])
    assert block.pack()
    full = block.packed.w13.untyped_storage().nbytes()
    try:
        block.offload_experts(range(block.cfg.num_experts // 2, block.cfg.num_experts))
        assert block.packed is not None and len(block.packed.ids) == block.cfg.num_experts // 2
        # the kept experts are views of the new, half-size pack: the old one is no longer referenced
        assert getattr(block.experts[0], gate).weight.untyped_storage().nbytes() == full // 2
        block.grouped = False  # respected even with a pack present
        x = torch.randn(7, block.gate.weight.shape[1])
        with torch.no_grad():
            block(x)
        assert block.packed is None
    finally:
        block.grouped = True
        block.offload_experts([])
    block.pack()
    block.to(torch.float64)  # moving the block drops its pack; the next forward packs again
    assert block.packed is None
    block.to(torch.float32)


def test_probe_runs_both_gemms():
    # D = 64, I = 36 in bf16: the second GEMM's rows (I x 2 bytes = 72) are not 16-byte aligned
    assert grouped.grouped_mm_supported(torch.device("cpu"), torch.float32, 64, 32)
    assert not grouped._probe(torch.device("cpu"), torch.bfloat16, 64, 36)


def test_without_a_grouped_gemm_the_loop_runs(monkeypatch):
    monkeypatch.setattr(grouped, "_SUPPORTED", {})
    monkeypatch.delattr(torch, "_grouped_mm")
    llm = LLM("tiny-qwen3-moe", progress=False)
    assert llm.load_info["grouped_experts"] is False
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=None)
    assert len(out[0].token_ids) > 0 and all(b.packed is None for b in _blocks(llm))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b"])
def test_grouped_on_cuda_bf16_real_shapes(preset):
    """torch's grouped GEMM runs for the real expert shapes in bf16 on the GPU and matches the loop."""
    from writescope.engine.model_loader import resolve_config

    cfg, _ = resolve_config(preset)
    block = SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=cfg.model_type == "deepseek_v2").to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
        block.offload_experts(range(cfg.moe.num_experts // 2, cfg.moe.num_experts))  # half on the host: both paths
        x = torch.randn(37, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        assert block.pack()
        got = block(x)
        block.grouped, block.packed = False, None
        ref = block(x)
    # the two paths sum in different orders (bf16 partial products, Mixtral: 14336 wide): allow one
    # bf16 rounding step at the output's largest magnitude (2^-7 of it; the H200 run saw 24 of
    # 151,552 Mixtral outputs differ by one such step), 2% relative elsewhere
    atol = max(2e-3, ref.float().abs().max().item() * 2**-7)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=atol)


@pytest.mark.gpu
def test_grouped_path_never_waits_for_the_device():
    """All experts on the GPU: routing, sorting, grouped GEMMs and the scatter run without a
    host sync (torch's sync debug mode turns any sync into an error)."""
    from writescope.engine.model_loader import resolve_config

    cfg, _ = resolve_config("qwen3-30b-a3b")
    block = SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=False).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
        assert block.pack()
        x = torch.randn(16, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        block(x)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            block(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
