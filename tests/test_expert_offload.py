"""Routed experts in host memory computed on the CPU give the all-device result."""

from __future__ import annotations

import pytest
import torch

from writescope import LLM
from writescope.attention.metadata import ForwardBatch
from writescope.engine.threads import usable_cpus
from writescope.kvcache.contiguous import ContiguousKVCache
from writescope.moe.block import SparseMoeBlock

from helpers import budget_plan, half_experts_budget


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


def test_vram_budget_offloads_what_the_plan_says_and_keeps_the_tokens():
    from writescope import SamplingParams
    from writescope.presets import preset_config

    cfg = preset_config("tiny-qwen3-moe")
    base = budget_plan()
    budget = half_experts_budget()  # room for half the routed experts plus the 8 experts' worth of streaming slots
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, vram_budget=budget, max_batch=2)
    assert llm.vram_plan.stream_slots == 8 * base.expert_bytes
    blocks = [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]
    assert sum(cfg.moe.num_experts - len(b.host_experts) for b in blocks) == base.experts_total // 2
    assert llm.load_info["experts_offloaded"] == base.experts_total - base.experts_total // 2
    assert all(b.stream_min_tokens is not None for b in blocks)
    ref = LLM("tiny-qwen3-moe", progress=False)
    prompts = [list(range(3, 3 + n)) for n in (70, 9)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)] == [
        o.token_ids for o in ref.generate(prompt_token_ids=prompts, sampling_params=params)
    ]


def test_too_small_budget_is_refused_before_loading(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the budget check")

    monkeypatch.setattr("writescope.engine.llm.load_model", no_load)
    with pytest.raises(ValueError, match="below the minimum"):
        LLM("qwen3-30b-a3b", progress=False, policy="gpu", vram_budget="2GiB", max_batch=4)


def test_thread_split_is_explicit(monkeypatch):
    """Host experts run with ``expert_threads``; CPU attention leaves the launching thread a core with CUDA."""
    from contextlib import contextmanager

    import writescope.moe.block as block_mod
    from writescope.engine.threads import default_attention_threads, intra_op_threads

    n = torch.get_num_threads()
    assert default_attention_threads(torch.device("cuda")) == max(1, n - 1)
    assert default_attention_threads(torch.device("cpu")) == n
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == n

    seen = []

    @contextmanager
    def spy(k):
        seen.append(k)
        yield

    monkeypatch.setattr(block_mod, "intra_op_threads", spy)
    experts = min(2, usable_cpus())  # each count within the CPUs this process may use
    llm = LLM("tiny-qwen3-moe", progress=False, expert_threads=experts, policy="static:0.5", cpu_threads=1)
    assert llm.expert_threads == experts and llm.attention_threads == 1 and llm.cache.decoder.cpu_threads == 1
    blocks = [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]
    for b in blocks:
        b.offload_experts(range(b.cfg.num_experts))
    llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=None)
    assert seen and set(seen) == {experts}  # the host experts' GEMMs on that many intra-op threads
    for bad in (0, usable_cpus() + 1):
        with pytest.raises(ValueError, match=f"expert_threads must be 1 to {usable_cpus()} .*got {bad}"):
            LLM("tiny-qwen3-moe", progress=False, expert_threads=bad)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2"])
def test_planned_host_experts_are_built_in_host_memory(preset):
    """Experts the plan puts on the host never take device memory: built there (the rest of the
    model here on the meta device, standing in for the GPU)."""
    from writescope.models import build_model
    from writescope.presets import preset_config

    cfg = preset_config(preset)
    where = {i: range(1, cfg.moe.num_experts) for i in cfg.moe.moe_layers}
    model = build_model(cfg, torch.float32, "meta", where)
    for i, layer in enumerate(model.model.layers):
        for name, p in layer.named_parameters():
            on_host = i in where and name.split(".")[1] == "experts" and int(name.split(".")[2]) >= 1
            assert p.device.type == ("cpu" if on_host else "meta"), (i, name, p.device)


def _fake_cuda(monkeypatch, reserved: int, total: int = 140 * 2**30) -> list:
    """torch.cuda's memory calls answered as a device holding ``reserved`` bytes; returns the
    fractions set."""
    import types

    fractions: list = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: reserved)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: reserved)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: fractions.append((f, i)))
    return fractions


def test_enforce_budget_refuses_warns_or_caps(monkeypatch):
    """After loading: weights already filling the budget are refused with the numbers (nothing
    capped); weights leaving less than the plan's working set warn; otherwise the cap is set."""
    from writescope.budget.apply import enforce_budget

    GiB, cuda = 2**30, torch.device("cuda")  # no index: the call must pick the current device
    fractions = _fake_cuda(monkeypatch, reserved=56 * GiB)
    with pytest.raises(ValueError, match=r"holds 56.00 GiB .* 29.26 GiB planned.* 32.00 GiB"):
        enforce_budget(cuda, 32 * GiB, planned=int(29.26 * GiB), working=2 * GiB)
    assert fractions == []
    fractions = _fake_cuda(monkeypatch, reserved=31 * GiB)
    with pytest.warns(RuntimeWarning, match="may run out"):
        enforce_budget(cuda, 32 * GiB, planned=29 * GiB, working=2 * GiB)
    assert fractions == [(32 / 140, 0)]
    fractions = _fake_cuda(monkeypatch, reserved=29 * GiB)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        held = enforce_budget(cuda, 32 * GiB, planned=29 * GiB, working=2 * GiB)
    assert held == {"allocated": 29 * GiB, "reserved": 29 * GiB} and fractions == [(32 / 140, 0)]


def test_adaptive_policy_under_a_budget_calibrates_once_before_the_weights_load(monkeypatch):
    """Under --vram-budget the cap leaves no device memory for a calibration: generate's LLM and
    bench both look the roofline up before loading, and never again after."""
    import writescope.engine.llm as engine
    from writescope.cli.main import main
    from writescope.scheduler.roofline import Roofline

    calls: list[str] = []
    real_load = engine.load_model

    def fake_calibrate(*a, **kw):
        calls.append("calibrate")
        return Roofline(1e-9, 1e-9)

    def spy_load(*a, **kw):
        calls.append("load")
        return real_load(*a, **kw)

    monkeypatch.setattr(engine, "load_or_calibrate", fake_calibrate)
    monkeypatch.setattr(engine, "load_model", spy_load)
    llm = LLM("tiny-qwen3-moe", progress=False, vram_budget="2GiB", policy="writescope")
    llm.roofline(llm.window)
    assert calls == ["calibrate", "load"]
    calls.clear()
    rc = main(["bench", "--model", "tiny-qwen3-moe", "--context", "64", "--batch", "1", "--steps", "1", "--policies",
               "writescope", "--vram-budget", "2GiB", "--quiet"])
    assert rc == 0 and calls == ["calibrate", "load"]
