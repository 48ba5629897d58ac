"""O, a decode layer step's work outside attention, and the split gate that uses it
(writescope/scheduler/other_work.py, roofline.split_pays)."""

from __future__ import annotations

import types

import pytest
import torch

from writescope.engine import timing
from writescope.kvcache.spec import Roofline
from writescope.scheduler import other_work as ow
from writescope.scheduler.roofline import WriteScopePolicy, split_pays

# the calibration of the H200 DeepSeek-V2-Lite grid (benchmarks/results/grid_deepseek-v2-lite_h200_run22.json)
DSV2 = Roofline(a=2.034e-08, b=1.986e-08, c_cpu=5.395e-04, c_gpu=1.350e-04, b_alone=2.100e-08, c_gpu_alone=2.366e-04)


def test_the_gate_with_o_keeps_streaming_where_it_hides_behind_the_layer_s_other_work():
    # DSV2 4 x 8K: the split (r = 0.031) ran at 0.75x gpu; O = 0.67 ms per layer step
    L = 4 * (8192 - 256)
    assert split_pays(L, 0.031, DSV2.a, DSV2)  # without O the gate let it through
    assert not split_pays(L, 0.031, DSV2.a, DSV2, other=0.67e-3)
    # DSV2 16 x 32K: the split (r = 0.469) ran at 1.44x gpu; O = 1.47 ms: it still pays
    L = 16 * (32768 - 256)
    assert split_pays(L, 0.469, DSV2.a, DSV2) and split_pays(L, 0.469, DSV2.a, DSV2, other=1.47e-3)


def test_host_experts_read_over_the_link_inside_o_count_on_the_link_side():
    # Qwen3-30B-A3B 4 x 32K (grid_qwen3-30b-a3b_h200_run22_b4.json): O = 3.41 ms of which about 2.37 ms
    # read host experts over the link; the split (r = 0.484) ran at 1.27x gpu
    q = Roofline(a=3.089e-08, b=3.541e-08, c_cpu=4.229e-04, c_gpu=0.0, b_alone=3.766e-08, c_gpu_alone=9.70e-05)
    L = 4 * (32768 - 256)
    assert not split_pays(L, 0.484, q.a, q, other=3.41e-3)  # as if streaming could hide behind all of O
    assert split_pays(L, 0.484, q.a, q, other=3.41e-3, other_link=2.37e-3)
    # no stand-alone calibration: the paper's r(L) stands, O or not
    assert split_pays(L, 0.5, q.a, Roofline(q.a, q.b), other=1.0)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _step(meter, clock, gaps, attn=1.0, batch=4):
    """One decode step: len(gaps) + 1 layers, each attention ``attn`` s, gaps between them."""
    for layer in range(len(gaps) + 1):
        meter.begin(layer, batch)
        clock.t += attn
        meter.end(layer)
        clock.t += gaps[layer] if layer < len(gaps) else 5.0  # after the last layer: sampling, not O


def test_o_is_the_median_gap_between_consecutive_layers_tracked_per_batch(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    m = ow.OtherWork(torch.device("cpu"), warm=2, every=3)
    assert m.seconds(4) is None and m.link(4) == 0.0
    _step(m, clock, [9.0, 9.0, 9.0])  # a batch size's first step captures its graphs: not measured
    _step(m, clock, [0.1, 0.3, 0.2])
    assert m.seconds(4) is None  # the step under way is read once the next one begins
    _step(m, clock, [0.5, 0.5, 0.5])
    assert m.seconds(4) == pytest.approx(0.2)  # the second step's median; the 5 s after its last layer is not a gap
    _step(m, clock, [1.0, 1.0, 1.0], batch=16)  # another batch size: its own estimate, its first step left out
    assert m.seconds(4) == pytest.approx(0.2 + 0.3 * (0.5 - 0.2)) and m.seconds(16) is None
    # after the warm steps, one in `every`: steps 3 and 4 at batch 4 unmeasured, step 5 measured
    for g in (9.0, 9.0, 2.0):
        _step(m, clock, [g] * 3)
    _step(m, clock, [0.0] * 3)
    # tracked as A is: the median of the last three samples (0.2, 0.5, 2.0) moves the estimate, not the 2.0 alone
    assert m.seconds(4) == pytest.approx(0.29 + 0.3 * (0.5 - 0.29))
    assert m.seconds(16) is None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="warm >= 0 and every >= 1"):
        ow.OtherWork(torch.device("cpu"), every=0)


def test_in_place_link_seconds_weighs_the_hit_host_experts():
    def block(host, in_place=True):
        return types.SimpleNamespace(host_experts=list(range(host)), host_pack=types.SimpleNamespace(expert_nbytes=1000),
                                     cfg=types.SimpleNamespace(num_experts=8, top_k=2),
                                     reads_host_experts_in_place=lambda tokens: in_place)

    blocks = [block(4), block(0), block(2, in_place=False)]
    link = ow.in_place_link_seconds(blocks, seconds_per_byte=1e-9, num_layers=2, max_tokens=4)
    hit = 8 * (1 - (1 - 2 / 8) ** 3)  # 3 tokens, top-2 of 8
    assert link(3) == pytest.approx(4 / 8 * hit * 1000 * 1e-9 / 2)
    assert ow.in_place_link_seconds([block(0), block(2, in_place=False)], 1e-9, 2, 4) is None


def test_the_engine_measures_o_in_decode_steps_and_the_writescope_gate_uses_it(monkeypatch):
    from writescope import LLM, SamplingParams

    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES", raising=False)  # two micro-batches are not measured
    llm = LLM("tiny-qwen3-moe", progress=False, policy="writescope", window=16)
    assert isinstance(llm.policy, WriteScopePolicy) and llm.policy.other is llm.other_work and llm.cache.other_work is llm.other_work
    prompts = [[1 + i for i in range(40)], [2 + i for i in range(50)]]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    o = llm.other_work.seconds(2)
    assert o is not None  # measured in this generate's decode steps
    seen = []
    real = split_pays
    monkeypatch.setattr("writescope.scheduler.roofline.split_pays", lambda *a, **k: (seen.append(a[4:] if len(a) > 4 else ()), real(*a, **k))[1])
    llm.policy.expect_batch(2)
    llm.policy.cpu_share(64)
    assert seen and seen[-1][0] == o  # O at this batch reaches the gate
    # the key a CUDA engine keeps its estimates under (built here on the CPU: same code)
    key = ow.engine_store_key(llm.device, llm.config, llm.dtype, llm._moe_blocks)
    assert key.startswith(f"v{ow.STORE_VERSION}|") and f"{llm.config.num_layers} layers" in key and "|0/" in key
    llm.set_policy("gpu")  # a new cache keeps the meter; the estimates stay
    assert llm.cache.other_work is llm.other_work and llm.other_work.seconds(2) == o


def test_estimates_are_kept_for_a_later_process_under_their_key(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    m = ow.OtherWork(torch.device("cpu"), store_key="machine|model")
    assert m.save() is None  # nothing measured: nothing written
    for batch, gaps in ((4, [9.0] * 3), (4, [0.1, 0.3, 0.2]), (8, [9.0] * 3), (8, [0.0] * 3)):  # first steps left out
        _step(m, clock, gaps, batch=batch)
    path = m.save()
    assert path == ow.store_path() and path.exists() and m.save() is None  # written once per new measurement
    again = ow.OtherWork(torch.device("cpu"), store_key="machine|model")
    assert again.seconds(4) == pytest.approx(0.2) and again.seconds(8) == 0.0  # the last step counts once saved
    assert ow.OtherWork(torch.device("cpu"), store_key="another").seconds(4) is None
    # another process's entries survive a save; a bad entry is left out alone
    import json

    doc = json.loads(path.read_text())
    doc["machine|model"][""]["x"] = 1.0
    doc["machine|model"][""]["16"] = float("inf")
    doc["other|model"] = {"": {"4": 0.5}}
    path.write_text(json.dumps(doc))
    assert ow.stored("machine|model") == {("", 4): pytest.approx(0.2), ("", 8): 0.0}
    for gaps in ([0.4] * 3, [0.0] * 3):
        _step(again, clock, gaps)
    _step(again, clock, [0.0] * 3)
    assert again.save() == path and json.loads(path.read_text())["other|model"] == {"": {"4": 0.5}}
    # kernels' switches: their own estimates (a bench row's POLICY@NAME=VALUE runs other kernels)
    monkeypatch.setenv("WRITESCOPE_MOE_KERNEL", "grouped")
    assert again.seconds(4) is None
    monkeypatch.delenv("WRITESCOPE_MOE_KERNEL")
    assert again.seconds(4) is not None
    for text in ("{not json", "null", "[]"):
        path.write_text(text)
        assert ow.stored("machine|model") == {}  # an unreadable file keeps nothing and breaks nothing
    _step(again, clock, [0.3] * 3)
    assert again.save() == path and ("", 4) in ow.stored("machine|model")  # and the next save writes it afresh
    assert ow.for_engine(torch.device("cpu"), None, torch.float32, []).store_key is None  # without CUDA nothing is kept


def test_o_is_not_used_where_a_per_step_expert_split_runs(monkeypatch):
    """With the joint model (host experts split per step), O measured under other policies' expert
    path reaches neither the gate nor the balance."""
    from writescope.scheduler import roofline as rl

    seen = []
    monkeypatch.setattr(rl, "split_pays", lambda *a, **k: (seen.append(a[4:]), True)[1])
    monkeypatch.setattr(rl, "joint_split", lambda L, X, costs: (0.3, None))
    policy = WriteScopePolicy(DSV2)
    policy.other = types.SimpleNamespace(seconds=lambda b, path=None: 1e-3, link=lambda b: 0.0, in_step_c=lambda threads, batch: None)
    policy.expect_batch(4)
    assert policy.cpu_share(32768) == pytest.approx(rl.roofline_share(4 * 32768, DSV2.a, DSV2.b, DSV2.c_cpu + 1e-3, DSV2.c_gpu))
    policy.experts = types.SimpleNamespace(expected_bytes=lambda b: 1e6, costs=lambda: None)
    assert policy.cpu_share(32768) == 0.3
    assert seen == [(1e-3, 0.0, None, 0.0), ()]  # O (no ring given: no cap) with the KV-only roofline; none with the joint one


def test_steps_split_into_two_micro_batches_are_not_measured(monkeypatch):
    """Two micro-batches interleave their layers' attentions, so their gaps are not O."""
    from writescope import LLM, SamplingParams

    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "2")
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16)
    prompts = [[1 + i for i in range(40)], [2 + i for i in range(50)]]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.cache.micro_batches == 2 and llm.other_work.seconds(2) is None
    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES")
    llm.set_policy("static:0.5")  # one micro-batch again: measured
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.cache.micro_batches == 1 and llm.other_work.seconds(2) is not None


def test_generate_frees_its_slots_and_returns_when_keeping_o_fails(monkeypatch):
    from writescope import LLM, SamplingParams

    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16)

    def broken():
        raise TypeError("a cache file that is not an object")

    monkeypatch.setattr(llm.other_work, "save", broken)
    with pytest.warns(UserWarning, match="work outside attention was not kept: TypeError"):
        outs = llm.generate(prompt_token_ids=[[1 + i for i in range(40)]], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(outs[0].outputs[0].token_ids) == 3 and llm.cache.active_slots == []


def test_nothing_is_measured_or_kept_while_paused():
    """Profiled steps (writescope profile) are slower than real ones: inside paused() no step is
    measured and no A kept, before and after it they are."""
    w = ow.OtherWork(torch.device("cpu"), warm=10, every=1)

    def step(batch=4):
        for layer in range(3):
            w.begin(layer, batch)
            w.end(layer)

    step()  # the first step at a batch size is never measured (graph captures)
    with w.paused():
        for _ in range(3):
            step()
        w.keep_in_step_a(8, 2e-8)
    assert w.seconds(4) is None and w.in_step_a(8) is None
    step()
    step()  # its begin folds the last step in
    assert w.seconds(4) is not None
    w.keep_in_step_a(8, 2e-8)
    assert w.in_step_a(8) == 2e-8
