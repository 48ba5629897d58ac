"""Micro-batched decode (models/decode_step.py, kvcache/inplace.py ``decode_groups``).

A decode step with a CPU part runs as two micro-batches whose layers interleave, so the CPU
attends one while the device runs the other. These tests check that the split happens where it
should, in the order it should, that it changes no token or logit, and that an error part-way
leaves the engine usable. Tiny presets in fp32 on the CPU.
"""

from __future__ import annotations

import gc

import pytest
import torch

from helpers import half_experts_budget
from writescope import LLM, SamplingParams
from writescope.attention.metadata import ForwardBatch
from writescope.attention.split import SplitDecoder
from writescope.kvcache.inplace import InplaceKVCache

D = 16
PROMPT_LENS = [70, 33, 5, 48]  # ragged: the CPU parts differ per sequence
STEPS = 24
LOGIT_TOL = 1e-4  # fp32; the same arithmetic per sequence, only its order of issue changes


@pytest.fixture(autouse=True)
def _two_micro_batches(monkeypatch):
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "2")  # not the default: these tests are about it


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _decode_logits(llm: LLM, prompts, steps: int) -> torch.Tensor:
    """Greedy decode of ``steps`` tokens by hand; returns the logits ``[steps, batch, vocab]``."""
    cache = llm.cache
    slots = [cache.allocate(len(p) + steps, prompt_len=len(p)) for p in prompts]
    try:
        batch = ForwardBatch.build(slots, [len(p) for p in prompts], [0] * len(prompts), "cpu")
        logits = llm.model(torch.tensor([t for p in prompts for t in p]), batch, cache)
        out = []
        for s in range(steps):
            nxt = logits.argmax(-1)
            batch = ForwardBatch.build(slots, [1] * len(prompts), [len(p) + s for p in prompts], "cpu")
            logits = llm.model(nxt, batch, cache)
            out.append(logits)
        return torch.stack(out)
    finally:
        for s in slots:
            cache.free(s)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
@pytest.mark.parametrize("policy", ["static:0.5", "cpu"])
def test_micro_batches_change_no_logit(preset, policy, monkeypatch):
    logits = {}
    for mb in ("1", "2"):
        monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", mb)
        llm = LLM(preset, progress=False, policy=policy, window=D, prefill_chunk_tokens=32)
        assert llm.cache.micro_batches == int(mb)
        calls = []
        real = llm.cache.decode_groups
        monkeypatch.setattr(llm.cache, "decode_groups", lambda b: (lambda g: (g is not None and calls.append(g), g)[1])(real(b)))
        logits[mb] = _decode_logits(llm, _prompts(llm.config.vocab_size), STEPS)
        if mb == "1":
            assert calls == []
        else:
            assert len(calls) == STEPS  # every decode step split (each has a CPU part), never the prefill
            assert all(len(g) == 2 and g[0][0] == 0 and g[0][1] == g[1][0] and g[1][1] == len(PROMPT_LENS) for g in calls)
    torch.testing.assert_close(logits["2"], logits["1"], atol=LOGIT_TOL, rtol=0)


def test_generate_tokens_equal_with_and_without_micro_batches(monkeypatch):
    tokens = {}
    for mb in ("1", "2"):
        monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", mb)
        llm = LLM("tiny-mixtral", progress=False, policy="static:0.5", window=D, prefill_chunk_tokens=32)
        outs = llm.generate(prompt_token_ids=_prompts(llm.config.vocab_size), sampling_params=SamplingParams(max_tokens=STEPS, ignore_eos=True))
        tokens[mb] = [o.token_ids for o in outs]
        assert llm.cache.active_slots == []
    assert tokens["2"] == tokens["1"]


def _cache_with(policy: str, lens: list[int]) -> tuple[InplaceKVCache, list[int]]:
    llm = LLM("tiny-qwen3-moe", progress=False, policy=policy, window=D)
    cache = llm.cache
    lay = llm.config.kv_layout
    slots = []
    for n in lens:
        slot = cache.allocate(n + 4, prompt_len=n)
        for layer in range(llm.config.num_layers):
            if n:
                cache.write(slot, layer, torch.randn(n, lay.kv_heads, lay.k_dim), torch.randn(n, lay.kv_heads, lay.v_dim))
        slots.append(slot)
    return cache, slots


def _decode_batch(slots, lens):
    return ForwardBatch.build(slots, [1] * len(slots), lens, "cpu")


def test_decode_groups_only_with_a_cpu_part_and_balanced():
    cache, slots = _cache_with("cpu", [160, 16, 16, 16, 16, 96])  # compute blocks 10, 1, 1, 1, 1, 6 (window D = 16 full)
    comp = [cache.sequence(s).n_comp[0] for s in slots]
    groups = cache.decode_groups(_decode_batch(slots, [160, 16, 16, 16, 16, 96]))
    assert groups is not None and len(groups) == 2
    (a0, cut), (c2, b1) = groups
    assert (a0, c2, b1) == (0, cut, len(slots))
    # the cut minimises the difference of CPU blocks between the halves
    best = min(abs(2 * sum(comp[:k]) - sum(comp)) for k in range(1, len(slots)))
    assert abs(2 * sum(comp[:cut]) - sum(comp)) == best
    # one sequence, a prefill pass, or no compute region: whole batches
    assert cache.decode_groups(_decode_batch(slots[:1], [160])) is None
    assert cache.decode_groups(ForwardBatch.build(slots[:2], [2, 1], [160, 16], "cpu")) is None
    gcache, gslots = _cache_with("gpu", [160, 96])
    assert gcache.decode_groups(_decode_batch(gslots, [160, 96])) is None
    cache.micro_batches = 1
    assert cache.decode_groups(_decode_batch(slots, [160, 16, 16, 16, 16, 96])) is None


def test_bad_micro_batches_value_is_named(monkeypatch):
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "3")
    with pytest.raises(ValueError, match="WRITESCOPE_MICRO_BATCHES='3'"):
        LLM("tiny-qwen3-moe", progress=False, policy="cpu", window=D)


def test_layers_interleave_begin_b_before_end_a(monkeypatch):
    """The order of issue: begin A0, begin B0, end A0, begin A1, end B0, begin B1, ..."""
    llm = LLM("tiny-qwen3-moe", progress=False, policy="cpu", window=D)
    log = []
    real_begin, real_end = SplitDecoder.decode_begin, SplitDecoder.decode_end

    def begin(self, layer, q, seqs, *a, **k):
        p = real_begin(self, layer, q, seqs, *a, **k)
        log.append(("begin", layer, len(seqs)))
        return p

    def end(self, p):
        log.append(("end", p.layer, len(p.seqs)))
        return real_end(self, p)

    monkeypatch.setattr(SplitDecoder, "decode_begin", begin)
    monkeypatch.setattr(SplitDecoder, "decode_end", end)
    prompts = [[5] * 40, [6] * 40, [7] * 40]  # equal CPU parts: cut at 1 or 2 (the middle of 3 is a tie: the first)
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
    L = llm.config.num_layers
    step = log[: 4 * L]  # the first decode step (the prefill does not go through the decoder)
    a, b = step[0][2], step[1][2]
    assert a + b == 3
    want = [("begin", 0, a), ("begin", 0, b)]
    for i in range(L):
        want += [("end", i, a)] + ([("begin", i + 1, a)] if i + 1 < L else [])
        want += [("end", i, b)] + ([("begin", i + 1, b)] if i + 1 < L else [])
    assert step == want


def test_an_error_in_one_micro_batch_waits_for_the_other_and_the_engine_goes_on(monkeypatch):
    llm = LLM("tiny-deepseek-v2", progress=False, policy="cpu", window=D)
    prompts = _prompts(llm.config.vocab_size)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    real_begin = SplitDecoder.decode_begin
    abandoned = []
    real_abandon = SplitDecoder.abandon
    monkeypatch.setattr(SplitDecoder, "abandon", lambda self, p: (abandoned.append(p.layer), real_abandon(self, p))[1])
    calls = {"n": 0}

    def flaky(self, layer, q, seqs, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # micro-batch B's layer 0 of the first decode step: A's is in flight
            raise RuntimeError("injected failure in micro-batch B")
        return real_begin(self, layer, q, seqs, *a, **k)

    monkeypatch.setattr(SplitDecoder, "decode_begin", flaky)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert abandoned == [0]  # A's layer 0 was waited for before the error went on
    assert llm.cache._pending == []
    assert llm.cache.active_slots == []
    monkeypatch.setattr(SplitDecoder, "decode_begin", real_begin)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)] == ref


def test_bench_times_micro_batched_layers():
    from writescope.bench.runner import BenchConfig, run_one

    llm = LLM("tiny-qwen3-moe", progress=False, policy="cpu", window=D)
    row = run_one(llm, BenchConfig([2], [64], ["cpu"], steps=3, window=D, warmup=False), 2, 64, "cpu")
    assert row.fits and row.attn_ms_per_layer > 0
    assert "attend_begin" not in vars(llm.cache) and "attend_end" not in vars(llm.cache)  # the timer was removed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_micro_batched_steps_on_cuda_match_whole_batches_and_never_wait(preset, monkeypatch):
    """On CUDA (Triton kernels, native worker, CUDA graphs): micro-batched decode logits equal
    whole-batch ones within fp32 rounding, and in bf16 a micro-batched step's layers issue without
    a host synchronisation (torch's sync debug mode raises on one).

    The logits are compared in fp32: in bf16 the halves' matrix products round differently from
    the whole batch's, and a token whose router scores nearly tie then takes another expert (on
    the dev CPU, tiny-qwen3-moe in bf16 moved 0.52 of a 4.2 logit scale at one (step, sequence)
    that way, every other row within 0.03; runs 10-12 on the H200 met the same 0.51)."""
    prompts, steps = [[5 + i % 50 for i in range(n)] for n in (90, 70, 33, 48)], 6
    logits = {}
    for dtype in ("fp32", "bf16"):
        for mb in ("1", "2"):
            monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", mb)
            llm = LLM(preset, device="cuda", dtype=dtype, progress=False, policy="static:0.5", window=16)
            cache, model = llm.cache, llm.model
            slots = [cache.allocate(len(p) + steps + 8, prompt_len=len(p)) for p in prompts]
            with torch.inference_mode():
                batch = ForwardBatch.build(slots, [len(p) for p in prompts], [0] * len(prompts), "cuda")
                out = model(torch.tensor([t for p in prompts for t in p], device="cuda"), batch, cache)
                rows, nxt = [], torch.tensor([p[-1] for p in prompts], device="cuda")
                for s in range(steps):
                    batch = ForwardBatch.build(slots, [1] * len(prompts), [len(p) + s for p in prompts], "cuda")
                    torch.cuda.synchronize()
                    # bf16 (the fp32 experts read routing back to the host), warm, and no window evicted into the compute region
                    quiet = dtype == "bf16" and s >= 2 and (len(prompts[0]) + s) % 16 not in (0, 15)
                    if quiet:
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        out = model(nxt, batch, cache)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                    rows.append(out.float())
            torch.cuda.synchronize()
            logits[dtype, mb] = torch.stack(rows)
            for slot in slots:
                cache.free(slot)
    scale = logits["fp32", "1"].abs().max().item()
    torch.testing.assert_close(logits["fp32", "2"], logits["fp32", "1"], atol=1e-3 * scale, rtol=0,
                               msg=lambda m: f"{m}\n(fp32; scale {scale:.4g})")
    assert torch.isfinite(logits["bf16", "2"]).all()
    # bf16: a router near-tie may move a (step, sequence) row; most rows stay within bf16 rounding
    rows = (logits["bf16", "2"] - logits["bf16", "1"]).abs().amax(-1).flatten()
    assert rows.median().item() <= 0.03 * logits["bf16", "1"].abs().max().item(), rows.tolist()


def _cuda_decode_logits(llm, prompts, steps: int, no_host_waits: bool = False) -> torch.Tensor:
    """Prefill ``prompts`` on CUDA, then ``steps`` decode steps fed the prompts' last tokens; the
    float logits ``[steps, batch, vocab]`` (the slots freed after). ``no_host_waits``: warm steps
    that evict no window into the compute region run with CUDA's sync debug mode at ``error``
    (a host wait in them fails the test)."""
    cache, model = llm.cache, llm.model
    slots = [cache.allocate(len(p) + steps + 8, prompt_len=len(p)) for p in prompts]
    try:
        with torch.inference_mode():
            batch = ForwardBatch.build(slots, [len(p) for p in prompts], [0] * len(prompts), "cuda")
            model(torch.tensor([t for p in prompts for t in p], device="cuda"), batch, cache)
            rows, nxt = [], torch.tensor([p[-1] for p in prompts], device="cuda")
            for s in range(steps):
                batch = ForwardBatch.build(slots, [1] * len(prompts), [len(p) + s for p in prompts], "cuda")
                torch.cuda.synchronize()
                quiet = no_host_waits and s >= 2 and (len(prompts[0]) + s) % 16 not in (0, 15)
                if quiet:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    rows.append(model(nxt, batch, cache).float())
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return torch.stack(rows)
    finally:
        for slot in slots:
            cache.free(slot)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_the_load_stream_and_the_cpu_partial_read_in_place_change_no_logit_on_cuda(preset, monkeypatch):
    """WRITESCOPE_LOAD_STREAM=own attends the load region's fills on a stream of their own that
    the merge waits for; WRITESCOPE_CPU_PARTIAL=in-place has the merge read the CPU worker's
    partial in pinned memory instead of a copy of it. Both are the same kernels on the same bytes,
    so bf16 logits equal those of the compute stream and the copy bit for bit, with and without
    micro-batches, and the step still never waits on the host. A missing wait (the merge reading
    partials not yet written) would show as a difference. (The pinned partial's lifetime,
    ``SplitDecoder._keep_until_read``, is not what this catches: the pinned buffers made after a
    merge are written after it in stream order, so bytes lent again too early would rarely differ.)"""
    prompts, steps = [[5 + i % 50 for i in range(n)] for n in (90, 70, 33, 48)], 6
    logits = {}
    variants = [("compute", "copy"), ("own", "copy"), ("compute", "in-place"), ("own", "in-place")]
    for mb in ("1", "2"):
        for where, partial in variants:
            monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", mb)
            monkeypatch.setenv("WRITESCOPE_LOAD_STREAM", where)
            monkeypatch.setenv("WRITESCOPE_CPU_PARTIAL", partial)
            llm = LLM(preset, device="cuda", dtype="bf16", progress=False, policy="static:0.5", window=16)
            cache = llm.cache
            assert (cache.decoder.load_stream is not None) == (where == "own")
            assert cache.decoder.partial_in_place == (partial == "in-place")
            logits[mb, where, partial] = _cuda_decode_logits(llm, prompts, steps, no_host_waits=True)
            assert cache.decoder.stats.streamed_bytes > 0 and cache.decoder.stats.cpu_parts > 0  # both sides ran
    for mb in ("1", "2"):
        for v in variants[1:]:
            assert torch.equal(logits[(mb, *v)], logits[(mb, *variants[0])]), (mb, v)


def test_generate_records_the_main_threads_issue_and_wait_per_decode_step():
    from writescope.cli.generate import format_timings

    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D)
    outs = llm.generate(prompt_token_ids=[[5] * 40, [6] * 20], sampling_params=SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(llm.decode_host) == 4  # the first token comes from the prefill
    assert all(issue > 0 and wait >= 0 for issue, wait in llm.decode_host)
    assert "decode step, main thread (median)" in format_timings(outs, llm.policy_name, None, llm.decode_host)


def test_generate_names_the_switches_it_ran_under(monkeypatch):
    from writescope.cli.generate import format_timings

    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D)
    outs = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2))
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "2")
    monkeypatch.setenv("WRITESCOPE_MOE_KERNEL", "grouped")
    monkeypatch.setenv("WRITESCOPE_API_KEY", "sk-secret")  # not a switch: never printed
    text = format_timings(outs, llm.policy_name, None, llm.decode_host)
    assert "WRITESCOPE_MICRO_BATCHES=2" in text and "WRITESCOPE_MOE_KERNEL=grouped" in text and "sk-secret" not in text


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
@pytest.mark.parametrize("mb", ["1", "2"])
def test_early_copies_change_no_logit(preset, mb, monkeypatch):
    """WRITESCOPE_LOAD_COPIES=early copies a layer's first fills at the end of the previous layer's
    load part. The same bytes are attended by the same arithmetic, so the logits are equal bit for
    bit; with two micro-batches the other half's layer would come in between and find the buffers
    holding other runs, so micro-batched steps copy nothing early."""
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", mb)
    logits, stats = {}, {}
    for copies in ("own-layer", "early"):
        monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", copies)
        llm = LLM(preset, progress=False, policy="static:0.5", window=D, prefill_chunk_tokens=32)
        assert llm.cache.decoder.copies_early == (copies == "early")
        logits[copies] = _decode_logits(llm, _prompts(llm.config.vocab_size), STEPS)
        stats[copies] = llm.cache.decoder.stats
    assert torch.equal(logits["early"], logits["own-layer"])
    assert stats["own-layer"].early_fills == stats["own-layer"].early_fills_wasted == 0
    layers = LLM(preset, progress=False, policy="static:0.5", window=D).config.num_layers
    if mb == "1":
        assert stats["early"].early_fills == STEPS * (layers - 1) and stats["early"].early_fills_wasted == 0
    else:
        assert stats["early"].early_fills == stats["early"].early_fills_wasted == 0


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe"])  # the budget below leaves host experts for this preset (fp32, batch 4)
def test_auto_copies_early_where_the_cpu_computes_host_experts(preset, monkeypatch):
    """WRITESCOPE_LOAD_COPIES=auto (the default): the engine turns early copies on from one token
    when the CPU computes the few-token host experts (expert_stream_share 0, about half of the
    experts in host memory), and leaves them off with every expert on the device; either way the
    logits are those of copying in the layer, bit for bit."""
    monkeypatch.delenv("WRITESCOPE_LOAD_COPIES", raising=False)
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "1")  # whole batches (the default; two copy nothing early)
    budget = half_experts_budget(preset, torch.float32, 4)
    llm = LLM(preset, progress=False, policy="static:0.5", window=D, max_batch=4,
              vram_budget=budget, expert_stream_share=0.0)
    assert any(b.host_experts for b in llm._moe_blocks)
    dec = llm.cache.decoder
    assert dec.copies_mode == "auto" and dec.early_from == 1
    auto = _decode_logits(llm, _prompts(llm.config.vocab_size), STEPS)
    assert dec.stats.early_fills == STEPS * (llm.config.num_layers - 1) and dec.stats.early_fills_wasted == 0
    llm.set_policy("gpu")  # a new cache: the engine sets its decoder's early_from again
    assert llm.cache.decoder.early_from == 1
    llm.cache.decoder.early_from = 99
    llm.set_expert_stream_share(0.0, attach=False)  # a changed expert path refreshes it, attached or not
    assert llm.cache.decoder.early_from == 1
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "own-layer")
    own = LLM(preset, progress=False, policy="static:0.5", window=D, max_batch=4,
              vram_budget=budget, expert_stream_share=0.0)
    assert not own.cache.decoder.copies_early
    assert torch.equal(auto, _decode_logits(own, _prompts(own.config.vocab_size), STEPS))
    monkeypatch.delenv("WRITESCOPE_LOAD_COPIES")
    assert LLM(preset, progress=False, policy="static:0.5", window=D).cache.decoder.early_from is None  # no host experts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset,share", [("tiny-qwen3-moe", None), ("tiny-deepseek-v2", None), ("tiny-qwen3-moe", 0.0)])
def test_early_copies_change_no_logit_on_cuda(preset, share, monkeypatch):
    """On CUDA the early copies run on the copy stream after the buffer's last reader in the
    previous layer, and the layer that uses them waits for their event: a missing wait or a buffer
    refilled too soon could show as a difference from copying in the layer itself (bf16, bit for
    bit), with every expert on the device (share None: no budget) or about half of them in host
    memory computed on the CPU after a routing read-back (share 0: the host waits mid-layer while
    the early copies run), one micro-batch and two (which copies nothing early). The tiny presets'
    load parts are one fill each; tests/test_gpu_inplace.py's test of the same switch holds the
    early copies back and streams several fills a layer through one to three buffers."""
    prompts, steps = [[5 + i % 50 for i in range(n)] for n in (90, 70, 33, 48)], 6
    logits = {}
    for mb in ("1", "2"):
        for copies in ("own-layer", "early"):
            monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", mb)
            monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", copies)
            llm = LLM(preset, device="cuda", dtype="bf16", progress=False, policy="static:0.5", window=16, max_batch=4,
                      vram_budget=half_experts_budget(preset, torch.bfloat16, 4) if share is not None else None, expert_stream_share=share)
            if share is not None:
                assert any(b.host_experts for b in llm._moe_blocks)
            logits[mb, copies] = _cuda_decode_logits(llm, prompts, steps)
            if copies == "early" and mb == "1":
                assert llm.cache.decoder.stats.early_fills > 0
            del llm  # the next model is built under this one's budget cap: free this one first
            gc.collect()
            torch.cuda.empty_cache()
    for mb in ("1", "2"):
        assert torch.equal(logits[mb, "early"], logits[mb, "own-layer"]), mb


def test_auto_splits_only_steps_whose_cpu_computes_no_host_experts():
    """``WRITESCOPE_MICRO_BATCHES=auto`` (scheduler/placement.py ``micro_batched``): a step of two
    or more sequences splits below the engine's ``cpu_experts_from`` threshold (or always, with
    none); 1 never splits and 2 always does, whatever the threshold."""
    from writescope.scheduler.placement import micro_batched

    assert micro_batched("auto", 16, None) and micro_batched("auto", 2)
    assert not micro_batched("auto", 1, None)  # one sequence: nothing to split
    assert micro_batched("auto", 7, 8) and not micro_batched("auto", 8, 8) and not micro_batched("auto", 16, 1)
    assert micro_batched(2, 16, 1) and not micro_batched(1, 16, None) and not micro_batched(2, 1, None)


@pytest.mark.parametrize("whole_at", [4, 3])
def test_auto_runs_whole_the_steps_the_policy_finds_whole_steps_pay_for(whole_at, monkeypatch):
    """``auto`` and a policy that finds whole steps paying at 4 sequences and the two-half split
    not (roofline.py ``WriteScopePolicy.splits_micro``): the cache runs those steps whole, asking
    with the batch's mean placed tokens, and still splits the other sizes; the logits are the
    same either way."""
    from writescope.scheduler.policies import StaticPolicy

    asked = []

    class Placed(StaticPolicy):
        def splits_micro(self, batch, placed_tokens):
            asked.append((batch, placed_tokens))
            return batch != whole_at

    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "auto")
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D)
    llm.cache.policy = Placed(0.5, "static:0.5")
    calls = []
    real = llm.cache.decode_groups
    monkeypatch.setattr(llm.cache, "decode_groups", lambda b: (lambda g: (calls.append(g), g)[1])(real(b)))
    logits = _decode_logits(llm, _prompts(llm.config.vocab_size), 4)
    decode_calls = calls[-4:]
    assert len(PROMPT_LENS) == 4 and len(decode_calls) == 4
    placed = sum(n // D * D for n in PROMPT_LENS) // 4  # the prompts' whole blocks; the first steps place none more
    assert asked[0] == (4, placed)
    if whole_at == 4:
        assert all(g is None for g in decode_calls)
    else:
        assert all(g is not None and len(g) == 2 for g in decode_calls)
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "1")
    whole = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D)
    torch.testing.assert_close(logits, _decode_logits(whole, _prompts(whole.config.vocab_size), 4), atol=LOGIT_TOL, rtol=0)


def test_auto_is_read_and_bad_values_name_it(monkeypatch):
    from writescope.kvcache.inplace import _micro_batches

    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "auto")
    assert _micro_batches() == "auto"
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "halves")
    with pytest.raises(ValueError, match="'halves'.*auto"):
        _micro_batches()


@pytest.mark.parametrize("host_experts_on_cpu", [False, True])
def test_auto_follows_the_expert_path_the_engine_sets(host_experts_on_cpu, monkeypatch):
    """The engine tells the cache (and writescope's balance) from how many tokens its CPU computes
    host experts: with every expert on the device none does, and auto splits every decode step;
    with half of them in host memory and the CPU computing all of their decode work
    (``expert_stream_share=0``) every step does, and auto splits none. Tokens and logits match the
    whole-batch steps either way (the split itself is checked above)."""
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "auto")
    kw = dict(max_batch=4, vram_budget=half_experts_budget("tiny-qwen3-moe", torch.float32, 4), expert_stream_share=0.0) \
        if host_experts_on_cpu else {}
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D, **kw)  # the budget is sized for the default chunk
    assert llm.cache.micro_batches == "auto" and any(b.host_experts for b in llm._moe_blocks) == host_experts_on_cpu
    assert llm.cache.cpu_experts_from == (1 if host_experts_on_cpu else None)
    calls = []
    real = llm.cache.decode_groups
    monkeypatch.setattr(llm.cache, "decode_groups", lambda b: (lambda g: (calls.append(g), g)[1])(real(b)))
    logits = _decode_logits(llm, _prompts(llm.config.vocab_size), 4)
    decode_calls = calls[-4:]
    assert len(decode_calls) == 4
    if host_experts_on_cpu:
        assert all(g is None for g in decode_calls)
    else:
        assert all(g is not None and len(g) == 2 for g in decode_calls)
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "1")
    whole = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D, **kw)
    torch.testing.assert_close(logits, _decode_logits(whole, _prompts(whole.config.vocab_size), 4), atol=LOGIT_TOL, rtol=0)
