"""Host experts streamed to the device for tokens-heavy steps (writescope.moe.streaming) give the
same result as computing them on the CPU or keeping them on the device (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

import writescope.moe.block as block_mod
import writescope.moe.streaming as streaming
from writescope import LLM
from writescope.moe.block import SparseMoeBlock

from helpers import budget_plan, half_experts_budget


def _blocks(llm):
    return [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2"])
def test_streamed_equals_cpu_and_device(preset, monkeypatch):
    llm = LLM(preset, progress=False)
    block = _blocks(llm)[0]
    E = block.cfg.num_experts
    x = torch.randn(301, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(streaming, "SLOTS", 1)  # one expert a group: even 3 host experts reuse a slot group
    streamed = []
    real = block_mod.run_streamed
    monkeypatch.setattr(block_mod, "run_streamed", lambda pack, ex, *a: (streamed.append(list(ex)), real(pack, ex, *a)))
    with torch.no_grad():
        on_device = block(x)
        block.offload_experts(range(E // 4, E))  # three quarters on the host: several slot groups
        assert block.host_pack is not None and block.host_pack.ids == list(range(E // 4, E))
        block.stream_min_tokens = None
        on_cpu = block(x)
        assert not streamed
        block.stream_min_tokens = 1
        all_streamed = block(x)
        assert streamed and set(streamed[-1]) <= set(range(E // 4, E)) and len(streamed[-1]) > 2 * streaming.SLOTS  # both groups reused
        block.stream_min_tokens = 60  # some streamed, the rest on the CPU
        mixed = block(x)
        block.stream_min_tokens, block.stream_share = 10**9, 0.5  # none by tokens; half of them by the share
        streamed.clear()
        shared = block(x)
        host_active = {int(e) for e in torch.unique(block_mod.route(x, block.gate.weight, block.cfg, block.deepseek)[1]) if e >= E // 4}
        assert len(streamed[-1]) == round(0.5 * len(host_active)) > 0 and set(streamed[-1]) < host_active
        block.stream_share = 1.0  # the default on CUDA: every host expert streamed, none left to the CPU
        streamed.clear()
        whole = block(x)
        assert set(streamed[-1]) == host_active
        block.stream_share = 0.0
    torch.testing.assert_close(whole, on_device, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared, on_device, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on_cpu, on_device, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(all_streamed, on_device, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed, on_device, rtol=1e-5, atol=1e-5)


def test_weight_slots_go_with_the_model():
    import gc

    llm = LLM("tiny-mixtral", progress=False)
    b = _blocks(llm)[0]
    b.offload_experts(range(1, b.cfg.num_experts))
    b.stream_min_tokens = 1
    with torch.no_grad():
        b(torch.randn(40, b.gate.weight.shape[1]))
    assert len(streaming._SLOTS) >= 1
    del llm, b
    gc.collect()
    assert len(streaming._SLOTS) == 0


def test_whole_model_with_streamed_experts_gives_the_same_tokens():
    llm = LLM("tiny-qwen3-moe", progress=False)
    prompts = [list(range(3, 3 + n)) for n in (200, 37)]
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts)]
    for b in _blocks(llm):
        b.offload_experts(range(3, b.cfg.num_experts))
        b.stream_min_tokens = 8  # prefill streams, decode computes on the CPU
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts)] == ref
    for b in _blocks(llm):
        b.stream_share = 0.5  # decode: half the host experts streamed, the rest on the CPU
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts)] == ref
    for b in _blocks(llm):
        b.stream_share = 1.0  # decode: all of them streamed (the default on CUDA)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts)] == ref


def test_expert_stream_share_reaches_every_block_and_is_checked_first(monkeypatch):
    import writescope.engine.llm as engine

    llm = LLM("tiny-mixtral", progress=False, expert_stream_share=0.25)
    assert {b.stream_share for b in _blocks(llm)} == {0.25}
    assert llm.expert_stream_share is None and llm.host_experts_in_decode() == "no routed experts in host memory"
    assert {b.stream_share for b in _blocks(LLM("tiny-mixtral", progress=False))} == {0.0}  # no CUDA: nothing to stream to
    monkeypatch.setattr(engine, "load_model", lambda *a, **k: pytest.fail("loaded weights despite a bad share"))
    for bad in (1.5, "auto"):  # a string is refused by name too (None is the default)
        with pytest.raises(ValueError, match="expert_stream_share must be a number in"):
            LLM("tiny-mixtral", progress=False, expert_stream_share=bad)


def test_default_share_streams_on_cuda_only():
    assert streaming.default_stream_share(torch.device("cuda")) == 1.0
    assert streaming.default_stream_share(torch.device("cpu")) == 0.0


def test_reported_share_is_the_one_decode_uses(monkeypatch):
    """LLM.expert_stream_share and its words follow what decode does: checked against a spy on
    the streaming path during generate (a decode batch of 2 tokens: only the share streams)."""
    import writescope.engine.llm as engine

    base, half = budget_plan(), half_experts_budget()  # half the experts on the host, with slots

    def load(share, budget=half):
        return LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, vram_budget=budget, max_batch=2,
                   expert_stream_share=share)

    streamed = []
    real = block_mod.run_streamed
    monkeypatch.setattr(block_mod, "run_streamed", lambda pack, experts, *a: (streamed.append(len(experts)), real(pack, experts, *a)))

    def decode_streams(llm) -> bool:
        streamed.clear()
        llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=None)  # 2-3 tokens: under stream_min_tokens
        return bool(streamed)

    cases = {None: (0.0, "few-token host experts computed on the CPU in decode"),  # no CUDA: the default is 0
             0.25: (0.25, "a share of 0.25 of the few-token host experts streamed to the device in decode, the rest computed on the CPU"),
             1: (1.0, "host experts streamed to the device in decode")}
    for share, (want, words) in cases.items():
        llm = load(share)
        assert llm.expert_stream_share == want and llm.host_experts_in_decode() == words
        assert decode_streams(llm) == (want > 0), share
    monkeypatch.setattr(engine, "default_stream_share", lambda device: 0.5)  # the rule is what LLM uses when none is given
    assert load(None).expert_stream_share == 0.5
    # every expert on the host and no room for streaming slots: nothing can stream, whatever the share
    no_slots = load(1, budget=base.gpu_min)
    assert no_slots.vram_plan.stream_slots == 0 and no_slots.expert_stream_share == 0.0 and not decode_streams(no_slots)
    assert no_slots.host_experts_in_decode() == "few-token host experts computed on the CPU in decode (no room for streaming slots in the budget)"
    monkeypatch.setattr(block_mod, "grouped_mm_supported", lambda *a: False)  # no grouped GEMM here: nothing streams
    llm = load(1)
    assert llm.expert_stream_share == 0.0
    assert llm.host_experts_in_decode() == "few-token host experts computed on the CPU in decode (no grouped GEMM for this device and dtype)"
    assert not decode_streams(llm)
    # a block with no host experts does not count: the others still stream
    llm = load(1)
    monkeypatch.undo()
    first = _blocks(llm)[0]
    first.offload_experts([])
    assert not first.host_experts and llm.expert_stream_share == 1.0


@pytest.mark.gpu
def test_decode_streams_every_host_expert_by_default_on_cuda():
    llm = LLM("tiny-mixtral", device="cuda", dtype="bf16", progress=False)
    assert {b.stream_share for b in _blocks(llm)} == {1.0}  # benchmarks/results/e2e.md, "Expert phase" (H200, 0d63fa9)


@pytest.mark.gpu
def test_host_experts_are_pinned_and_streamed_on_cuda():
    llm = LLM("tiny-qwen3-moe", device="cuda", dtype="bf16", progress=False)
    block = _blocks(llm)[0]
    x = torch.randn(257, block.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = block(x)
        block.offload_experts(range(4, block.cfg.num_experts))
        assert block.host_pack.w13.is_pinned()
        block.stream_min_tokens = 1
        got = block(x)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
