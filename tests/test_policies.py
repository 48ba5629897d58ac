"""End to end: every placement policy gives the tokens and logits of ``resident``.

Tiny presets in fp32 on the CPU (the "GPU" side runs as CPU tensors), a ragged batch whose
prompts span several D-windows (D = 16), prefilled in chunks and decoded long enough that
windows are evicted to both host regions.
"""

from __future__ import annotations

import pytest
import torch

from helpers import hf_reference_checkpoint
from writescope import LLM, SamplingParams
from writescope.attention.metadata import ForwardBatch
from writescope.kvcache.inplace import InplaceKVCache

PRESETS = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2"]
POLICIES = ["gpu", "cpu", "static:0.5", "static:0.2"]
PROMPT_LENS = [70, 33, 5]  # ragged; 70 = 4 blocks + 6 in the window
STEPS = 40  # > 2 windows of decode
D = 16
LOGIT_TOL = 1e-4  # fp32: split attention reorders sums (observed ~2e-6)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=PRESETS)
def preset(request):
    llm = LLM(request.param, progress=False, policy="resident")
    prompts = _prompts(llm.config.vocab_size)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    return request.param, prompts, params, ref, _teacher_forced_logits(llm, prompts, ref)


@torch.no_grad()
def _teacher_forced_logits(llm: LLM, prompts, continuations) -> torch.Tensor:
    """Logits ``[1 + STEPS - 1, batch, vocab]``: prefill last-token logits, then each decode step
    fed the reference continuation (so policies are compared on identical inputs)."""
    cache = llm.cache
    slots = [cache.allocate(len(p) + STEPS, prompt_len=len(p)) for p in prompts]
    try:
        batch = ForwardBatch.build(slots, [len(p) for p in prompts], [0] * len(prompts), "cpu")
        out = [llm.model(torch.tensor([t for p in prompts for t in p]), batch, cache)]
        for s in range(STEPS - 1):
            batch = ForwardBatch.build(slots, [1] * len(prompts), [len(p) + s for p in prompts], "cpu")
            out.append(llm.model(torch.tensor([c[s] for c in continuations]), batch, cache))
            if isinstance(cache, InplaceKVCache):
                for slot in slots:
                    cache.sequence(slot).check_invariants()
        return torch.stack(out)
    finally:
        for s in slots:
            cache.free(s)


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matches_resident(preset, policy):
    name, prompts, params, ref_tokens, ref_logits = preset
    llm = LLM(name, progress=False, policy=policy, window=D, prefill_chunk_tokens=32)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == ref_tokens
    # the batch really spilled: blocks in the host regions the policy allows
    placed = [o.kv_placement for o in outs]
    assert sum(p["compute"] + p["load"] for p in placed) > 0
    if policy == "gpu":
        assert all(p["compute"] == 0 for p in placed)
    if policy == "cpu":
        assert all(p["load"] == 0 for p in placed)
    if policy.startswith("static"):
        assert sum(p["compute"] for p in placed) > 0 and sum(p["load"] for p in placed) > 0
    assert llm.cache.active_slots == []
    logits = _teacher_forced_logits(llm, prompts, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGIT_TOL, rtol=0)


def test_policy_errors_leave_nothing_allocated():
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        LLM("tiny-qwen3-moe", progress=False, policy="fast")
    with pytest.raises(ValueError, match=r"R must be a number in \[0, 1\].*policies: resident"):
        LLM("tiny-qwen3-moe", progress=False, policy="static:2")
    with pytest.raises(ValueError, match=r"policy 'monolithic:2': R must be a number in \[0, 1\] \(e.g. monolithic:0.5\)"):
        LLM("tiny-qwen3-moe", progress=False, policy="monolithic:2")  # named as given, not as the static share inside it
    with pytest.raises(ValueError, match=r"@switches .* are for bench and profile rows; here set WRITESCOPE_CPU_PARTIAL=copy in the environment before the command "
                       r"and give the policy alone \('static:0.5'\)"):
        LLM("tiny-qwen3-moe", progress=False, policy="static:0.5@WRITESCOPE_CPU_PARTIAL=copy")
    with pytest.raises(ValueError, match="cpu_threads"):
        LLM("tiny-qwen3-moe", progress=False, policy="cpu", cpu_threads=0)
    with pytest.raises(ValueError, match="window"):
        LLM("tiny-qwen3-moe", progress=False, policy="cpu", window=0)


def test_sliding_window_model_needs_resident(tmp_path):
    path = hf_reference_checkpoint("tiny-mixtral", tmp_path / "m", sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=8.*resident"):
        LLM(str(path), progress=False, policy="gpu")


def test_capacity_refused_before_allocating(monkeypatch):
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D)
    prompts = _prompts(llm.config.vocab_size)
    llm.pinned_budget = 1024  # bytes: far below the load region's worst case
    with pytest.raises(ValueError, match="pinned budget"):
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4))
    assert llm.cache.active_slots == []
    monkeypatch.setattr("writescope.engine.llm.available_memory", lambda device: 4096)
    llm.pinned_budget = None
    with pytest.raises(ValueError, match="host memory"):
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4))
    assert llm.cache.active_slots == []
    monkeypatch.undo()
    out = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4))
    assert len(out) == 3 and llm.cache.active_slots == []


@pytest.mark.parametrize("r", [0.0, 0.1, 0.25, 0.5, 0.7, 1.0])
def test_routing_tracks_the_share_and_plans_prefill_compute_first(r):
    from writescope.scheduler.policies import COMPUTE, StaticPolicy, route_block

    policy, Dw, P = StaticPolicy(r), 16, 16 * 10 + 5
    homes, n_c = [], 0
    for j in range(200):  # 10 prefill blocks, then 190 decode evictions
        region = route_block(policy, j, P, Dw, n_c, compute_last=False)
        homes.append(region)
        n_c += region == COMPUTE
        if j >= 9:  # from the end of the prefill on, the placed CPU share stays within one block of r
            assert abs(n_c - r * (j + 1)) <= 1, (j, n_c)
    plan = homes[:10]
    assert plan == sorted(plan), f"prefill plan not compute-first: {plan}"  # COMPUTE = 0 < LOAD = 1
    assert plan.count(COMPUTE) == int(r * P / Dw + 0.5)
    # prefill and decode round halves the same way: r = 0.5 over one block goes to the CPU
    assert route_block(StaticPolicy(0.5), 0, Dw, Dw, 0) == route_block(StaticPolicy(0.5), 0, 0, Dw, 0) == COMPUTE


@pytest.mark.parametrize("r", [0.0, 0.25, 0.5, 1.0])
def test_compute_last_plans_the_same_blocks_at_the_other_end(r):
    """WRITESCOPE_PROMPT_PLAN=compute-last: the prompt's plan has as many compute blocks, all after
    its load blocks; decode routing is the same."""
    from writescope.scheduler.policies import COMPUTE, StaticPolicy, route_block

    policy, Dw, P = StaticPolicy(r), 16, 16 * 10 + 5
    first = [route_block(policy, j, P, Dw, 0, compute_last=False) for j in range(10)]
    last = [route_block(policy, j, P, Dw, 0, compute_last=True) for j in range(10)]
    assert [route_block(policy, j, P, Dw, 0) for j in range(10)] == last  # the default: compute blocks last
    assert last.count(COMPUTE) == first.count(COMPUTE)
    assert last == sorted(last, reverse=True), f"compute blocks not last: {last}"
    for n_c in range(12):
        assert route_block(policy, 10 + n_c, P, Dw, n_c, compute_last=True) == route_block(policy, 10 + n_c, P, Dw, n_c)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_compute_last_prompt_plan_gives_resident_tokens(monkeypatch, preset):
    """The compute region at the prompt's end, read back by later chunks of a chunked prefill and
    attended by the CPU in decode: the same greedy tokens as all KV on the device."""
    from writescope.scheduler.policies import COMPUTE, LOAD

    llm = LLM(preset, progress=False, prefill_chunk_tokens=96)
    prompts = [list(range(3, 3 + n)) for n in (300, 17, 129)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    monkeypatch.setenv("WRITESCOPE_PROMPT_PLAN", "compute-last")
    llm.set_policy("static:0.5", window=16)
    slot = llm.cache.allocate(320, prompt_len=300)
    plan = llm.cache.sequence(slot).prompt_plan()
    assert plan[0] == LOAD and plan[-1] == COMPUTE
    llm.cache.free(slot)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == ref


def test_set_policy_switches_cache_and_keeps_weights():
    llm = LLM("tiny-qwen3-moe", progress=False, policy="resident")
    prompts = _prompts(llm.config.vocab_size)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    weights = llm.model.lm_head.weight
    llm.set_policy("static:0.5", window=D)
    assert isinstance(llm.cache, InplaceKVCache) and llm.policy_name == "static:0.5"
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)] == ref
    assert llm.model.lm_head.weight is weights
    with pytest.raises(ValueError, match="unknown policy"):
        llm.set_policy("nope")
    assert llm.policy_name == "static:0.5"  # unchanged after the error


def test_single_pass_prefill_reads_nothing_back(monkeypatch):
    """Decode reads the compute region in place and the load region only by streaming; only a
    prompt prefilled in several chunks, one pass after another, reads earlier KV back to the
    device (run layer by layer, the default, it is kept there: tests/test_prefill_order.py)."""
    monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", "chunk")
    prompts = _prompts(4096)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    one = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D)
    one.generate(prompt_token_ids=prompts, sampling_params=params)
    assert one.cache.prefill_readback_bytes == 0
    assert one.cache.decoder.stats.streamed_bytes > 0 and one.cache.decoder.stats.cpu_tokens > 0
    chunked = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D, prefill_chunk_tokens=32)
    chunked.generate(prompt_token_ids=prompts, sampling_params=params)
    assert chunked.cache.prefill_readback_bytes > 0


@pytest.mark.parametrize("policy", ["gpu", "static:0.5", "static:0.9"])
def test_pinned_check_covers_what_the_slabs_reserve(policy):
    """check_capacity's pinned figure is at least what the load-region slabs really reserve."""
    from writescope.kvcache.sequence import load_blocks_reserved

    llm = LLM("tiny-qwen3-moe", progress=False, policy=policy, window=D)
    cache = llm.cache
    prompts = _prompts(llm.config.vocab_size)
    slots = [cache.allocate(len(p) + STEPS, prompt_len=len(p)) for p in prompts]
    try:
        for s, p in zip(slots, prompts):  # fill to capacity so every slab that can grow has grown
            for layer in range(cache.num_layers):
                n = len(p) + STEPS
                k = torch.randn(n, cache.layout.kv_heads, cache.layout.k_dim)
                cache.write(s, layer, k, torch.randn(n, cache.layout.kv_heads, cache.layout.v_dim))
        for s, p in zip(slots, prompts):
            reserved = sum(slab.nblk for slab in cache.sequence(s).slabs)
            assert reserved <= load_blocks_reserved(cache.policy, (len(p) + STEPS) // D)
    finally:
        for s in slots:
            cache.free(s)


@pytest.mark.parametrize("policy", ["gpu", "static:0.5", "monolithic:0.5"])
def test_load_region_read_in_place_matches_resident(preset, policy, monkeypatch):
    """WRITESCOPE_LOAD_READ=in-place: the load part attends each slab's run where it lies (on
    the CPU stand-in, the host tensor itself; on CUDA a view of the pinned bytes), with no
    ping-pong buffers and none in the budget: the same tokens and logits as resident."""
    monkeypatch.setenv("WRITESCOPE_LOAD_READ", "in-place")
    name, prompts, params, ref_tokens, ref_logits = preset
    llm = LLM(name, progress=False, policy=policy, window=D, prefill_chunk_tokens=32)
    assert llm.cache.spec.load_read == "in-place" and llm.cache.spec.pingpong_total_bytes() == 0
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == ref_tokens
    dec = llm.cache.decoder
    if policy.startswith("monolithic"):  # its GPU share is re-laid out into staging every step, read in place from there
        assert dec.stats.prepared_bytes > 0
    else:
        assert sum(o.kv_placement["load"] for o in outs) > 0  # the load region was used
    assert dec.in_place and dec._buffers == [] and dec.stats.streamed_bytes > 0
    logits = _teacher_forced_logits(llm, prompts, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGIT_TOL, rtol=0)


def test_load_read_is_checked(monkeypatch):
    from writescope.config import KVLayout
    from writescope.kvcache.spec import PartitionSpec

    monkeypatch.setenv("WRITESCOPE_LOAD_READ", "zero")
    with pytest.raises(ValueError, match="WRITESCOPE_LOAD_READ='zero': use 'copy' \\(the default\\) or 'in-place'"):
        PartitionSpec(KVLayout(1, 16, 16, False), 1, torch.float32)
    with pytest.raises(ValueError, match="load_read must be one of copy, in-place, got 'x'"):
        PartitionSpec(KVLayout(1, 16, 16, False), 1, torch.float32, load_read="x")


@pytest.mark.parametrize("last", [True, False, None])
def test_the_prompt_plan_asks_the_policy_once_and_matches_block_routing(last, monkeypatch):
    """``prompt_plan``: r(P) asked once for the whole prompt (a sequence's plan used to ask it
    once a block), the same regions as ``route_block`` gives block by block; None follows
    WRITESCOPE_PROMPT_PLAN (default compute-last)."""
    from writescope.scheduler.policies import StaticPolicy, prompt_plan, route_block

    monkeypatch.delenv("WRITESCOPE_PROMPT_PLAN", raising=False)
    asked = []

    class Counting(StaticPolicy):
        def cpu_share(self, placed_tokens):
            asked.append(placed_tokens)
            return super().cpu_share(placed_tokens)

    policy, Dw = Counting(0.3), 16
    for P in (0, 1, 15, 16, 17, 16 * 10 + 5, 4097):
        asked.clear()
        plan = prompt_plan(policy, P, Dw, last)
        assert asked == [P] and len(plan) == P // Dw
        assert plan == [route_block(policy, j, P, Dw, 0, last) for j in range(P // Dw)]
        assert plan == sorted(plan, reverse=last is not False)  # compute-last: LOAD = 1 first; compute-first: COMPUTE = 0 first
