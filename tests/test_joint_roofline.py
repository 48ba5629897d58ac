"""The joint roofline for KV and host experts (scheduler/joint.py, expert_work.py; issue 16): its
limits and clamps against the KV-only r(L), optimality against a brute-force search, the per-step
whole-expert split, the tracker of E, and the whole model under it (same tokens, the split in the
trace)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from helpers import half_experts_budget
from writescope.kvcache.spec import Roofline
from writescope.scheduler.expert_work import ExpertWork, expected_hit_experts
from writescope.scheduler.joint import JointCosts, joint_split, step_times, streamed_count
from writescope.scheduler.roofline import WriteScopePolicy, roofline_share


def _t(L, X, r, s, c):
    return max(step_times(L, X, r * L, (1 - s) * X, c))


@pytest.mark.parametrize("seed", range(20))
def test_without_host_experts_it_is_the_paper_s_r(seed):
    rng = random.Random(seed)
    a, b = rng.uniform(1e-9, 1e-7), rng.uniform(1e-9, 1e-7)
    c_cpu, c_gpu = rng.uniform(0, 2e-3), rng.uniform(0, 2e-3)
    c = JointCosts(a, b, 1e-11, 1e-11, c_cpu, c_gpu)
    for L in (1, 15, 16, 17, 4097, 10**6):
        r, s = joint_split(L, 0, c)
        assert r == pytest.approx(roofline_share(L, a, b, c_cpu, c_gpu), abs=1e-12)
        assert s == 1.0  # no experts: nothing to split


def test_without_host_kv_only_the_experts_split():
    c = JointCosts(a=5e-8, b=2e-8, e=1e-11, g=2e-11, c_cpu=1e-4, c_gpu=1e-4)
    r, s = joint_split(0, 2e8, c)
    assert r == 0.0 and 0 < s < 1
    cpu, link = step_times(0, 2e8, 0, (1 - s) * 2e8, c)
    assert cpu == pytest.approx(link, rel=1e-9)  # the two sides finish together
    assert joint_split(0, 0, c) == (0.0, 1.0)
    # a CPU whose fixed cost exceeds the whole link time takes nothing
    assert joint_split(100, 1e3, JointCosts(1e-9, 1e-9, 1e-12, 1e-12, c_cpu=1.0, c_gpu=0.0)) == (0.0, 1.0)
    # a free CPU takes everything (clamped at 1)
    assert joint_split(100, 1e3, JointCosts(0.0, 1e-6, 0.0, 1e-6)) == (1.0, 0.0)


@pytest.mark.parametrize("seed", range(30))
def test_the_split_is_optimal_against_a_brute_force_search(seed):
    rng = random.Random(100 + seed)
    c = JointCosts(a=rng.uniform(1e-9, 5e-8), b=rng.uniform(1e-9, 5e-8), e=rng.uniform(1e-12, 5e-11), g=rng.uniform(1e-12, 5e-11),
                   c_cpu=rng.uniform(0, 1e-3), c_gpu=rng.uniform(0, 1e-3))
    L, X = rng.choice([0, 1, 17, 4097, 5e5]), rng.choice([0, 9.4e6, 1.3e8, 2e9])
    r, s = joint_split(L, X, c)
    assert 0 <= r <= 1 and 0 <= s <= 1
    best = min(_t(L, X, i / 100, j / 100, c) for i in range(101) for j in range(101))
    assert _t(L, X, r, s, c) <= best * (1 + 1e-9) + 1e-15


def test_the_cpu_takes_first_what_it_is_relatively_better_at():
    # the CPU reads experts at 70 GB/s and latent KV at 45 GB/s; the link both at 52 GB/s (per byte)
    kv_bytes = 576 * 2
    c = JointCosts(a=kv_bytes / 45e9, b=kv_bytes / 52e9, e=1 / 70e9, g=1 / 52e9)
    L, X = 16 * 32768, 14 * 9.4e6
    r, s = joint_split(L, X, c)
    assert s == 0.0 and 0 < r < 1  # every host expert on the CPU, then KV until the two sides meet
    c2 = JointCosts(a=kv_bytes / 90e9, b=kv_bytes / 52e9, e=1 / 20e9, g=1 / 52e9)  # a CPU slow on experts
    r2, s2 = joint_split(L, X, c2)
    assert s2 == 1.0 and r2 > 0  # KV first; experts stay streamed


def test_whole_expert_split_against_every_k():
    rng = random.Random(7)
    c = JointCosts(a=1e-8, b=1e-8, e=1 / 60e9, g=1 / 52e9)
    for _ in range(50):
        sizes = [rng.choice([9.4e6, 2.8e7])] * rng.randint(0, 30)
        cpu_s, link_s = rng.uniform(0, 5e-3), rng.uniform(0, 5e-3)
        k = streamed_count(sizes, cpu_s, link_s, c)
        times = [max(cpu_s + sum(sizes[j:]) * c.e, link_s + sum(sizes[:j]) * c.g) for j in range(len(sizes) + 1)]
        assert times[k] <= min(times) * (1 + 1e-12) and k == times.index(min(times))  # the first (fewest streamed) of the best
    assert streamed_count([1e7] * 5, 1.0, 0.0, c) == 5  # a busy CPU: stream them all
    assert streamed_count([1e7] * 5, 0.0, 1.0, c) == 0  # a busy link: the CPU takes them all
    assert streamed_count([], 0.0, 0.0, c) == 0


def test_the_cpu_call_s_fixed_part_moves_whole_experts_to_the_link():
    """Two experts of 10 MB, E 1e-11 and G 1.5e-11 s/byte: without a fixed part one is streamed
    (1.5e-4 s against 2e-4 all on the CPU); a fixed part of 2e-4 s ties one and two streamed (the
    fewer win), 3e-4 s streams both. Streaming all pays no CPU call."""
    c = JointCosts(a=1e-8, b=1e-8, e=1e-11, g=1.5e-11)
    assert [streamed_count([1e7] * 2, 0.0, 0.0, c, call) for call in (0.0, 2e-4, 3e-4)] == [1, 1, 2]
    assert streamed_count([1e7] * 2, 0.0, 0.0, JointCosts(a=1e-8, b=1e-8, e=1e-12, g=1e-9), 1.0) == 2


def test_a_cpu_left_idle_gets_one_expert_now_and_then():
    """When every step streams all of its 2+ hit host experts (E looks too high to give the CPU any),
    every PROBE_EVERY-th such step gives one to the CPU, so E is measured again; a step that gives
    the CPU some resets the count, and a single hit expert is never forced."""
    from writescope.scheduler.expert_work import PROBE_EVERY, ExpertWork

    class Decoder:
        last_split = (0, 0)  # a decode step

    pol = WriteScopePolicy(Roofline(a=2e-8, b=2e-8, c_cpu=0.0, c_gpu=0.0))
    work = ExpertWork(e=1e-6, g=1e-12, host_fraction=0.5, expert_bytes=10**7, num_experts=8, top_k=2, decoder=Decoder(), policy=pol)
    ks = [work.choose([10**7] * 3) for _ in range(2 * PROBE_EVERY)]
    assert ks.count(2) == 2 and ks[PROBE_EVERY - 1] == 2 and ks[2 * PROBE_EVERY - 1] == 2 and set(ks) == {2, 3}
    assert all(work.choose([10**7]) == 1 for _ in range(2 * PROBE_EVERY))  # one expert: never forced
    work.e = type(work.e)(1e-15, work.e.alpha, work.e.window)  # a CPU now far faster than the link
    assert work.choose([10**7] * 3) == 0 and work.unmeasured == 0


def test_e_is_tracked_without_the_call_s_fixed_part():
    from writescope.scheduler.expert_work import ExpertWork

    work = ExpertWork(e=1e-11, g=2e-11, host_fraction=0.5, expert_bytes=10**8, num_experts=8, top_k=2, call=1e-3, alpha=1.0, window=1)
    work.observe(1e-3 + 1e-11 * 10**8, 10**8)  # one expert: the fixed part and 1 ms of weights
    assert work.e.value == pytest.approx(1e-11)
    work.observe(1e-3, 10**8)  # a call no longer than the fixed part: a tenth of its time per byte, never 0
    assert work.e.value == pytest.approx(1e-4 / 10**8)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="fixed seconds per expert call"):
            ExpertWork(e=1e-11, g=2e-11, host_fraction=0.5, expert_bytes=1, num_experts=8, top_k=2, call=bad)


def test_the_cpu_expert_cost_is_measured_as_a_line():
    """E (seconds per byte, > 0) and the call's fixed part (>= 0) from the tiny model's host
    experts; with one host expert the fixed part is 0."""
    from writescope.scheduler.expert_work import measure_cpu_expert_cost

    llm = _half_on_host_llm()
    block = next(b for b in _blocks(llm) if len(b.host_experts) >= 2)
    e, call = measure_cpu_expert_cost(block)
    assert 0 < e and math.isfinite(e) and 0 <= call and math.isfinite(call)  # timings: no bound on their size
    e1, call1 = measure_cpu_expert_cost(block, experts=1)
    assert e1 > 0 and call1 == 0.0


def test_the_expert_cost_line_and_when_it_is_not_believed():
    from writescope.scheduler.expert_work import MAX_CALL_SHARE, expert_cost_line

    mb = 352 * 2**20  # a Mixtral-8x7B expert
    # a clean line: 3.5 ms per expert and 0.2 ms a call
    e, call = expert_cost_line(0.2e-3 + 3.5e-3, 0.2e-3 + 8 * 3.5e-3, 8, mb)
    assert e == pytest.approx(3.5e-3 / mb, rel=1e-9) and call == pytest.approx(0.2e-3, rel=1e-6)
    # run 36: the one-expert call timed at 13.4 ms, eight at 16.3: a 13 ms fixed part beside 855 GB/s
    # is not believed; the eight experts' call is taken per byte
    e, call = expert_cost_line(13.4e-3, 16.3e-3, 8, mb)
    assert call == 0.0 and e == pytest.approx(16.3e-3 / (8 * mb))
    # just inside and just past the share
    for share, believed in ((MAX_CALL_SHARE * 0.99, True), (MAX_CALL_SHARE * 1.01, False)):
        one = 4e-3
        fixed = share * one
        many = fixed + 8 * (one - fixed)
        e, call = expert_cost_line(one, many, 8, mb)
        assert (call > 0) == believed
    # a slope that noise made <= 0, one expert, odd sizes
    assert expert_cost_line(5e-3, 4e-3, 8, mb) == (4e-3 / (8 * mb), 0.0)
    assert expert_cost_line(5e-3, 5e-3, 1, 17) == (5e-3 / 17, 0.0)
    e, call = expert_cost_line(0.1e-3 + 1e-3, 0.1e-3 + 4097 * 1e-3, 4097, 15)
    assert e == pytest.approx(1e-3 / 15) and call == pytest.approx(0.1e-3)
    for bad in ((0.0, 1e-3, 8, mb), (1e-3, float("nan"), 8, mb), (1e-3, float("inf"), 8, mb), (1e-3, 1e-3, 0, mb), (1e-3, 1e-3, 8, 0)):
        with pytest.raises(ValueError, match="expert call timings"):
            expert_cost_line(*bad)


def test_costs_are_checked():
    with pytest.raises(ValueError, match="cost e"):
        JointCosts(1e-9, 1e-9, float("nan"), 1e-11)
    with pytest.raises(ValueError, match="input X"):
        joint_split(1, -1, JointCosts(1e-9, 1e-9, 1e-11, 1e-11))
    with pytest.raises(ValueError, match="positive and finite"):
        ExpertWork(0.0, 1e-11, 0.5, 10, 8, 2)


def test_the_tracker_follows_a_step_change_in_e():
    rf = Roofline(2e-8, 2e-8, 1e-4, 1e-4)
    pol = WriteScopePolicy(rf)
    work = ExpertWork(1e-11, 2e-11, 0.5, 10**7, 128, 8, policy=pol)
    for _ in range(5):
        work.observe(1e-11 * 1e8, 10**8)
    assert work.e.value == pytest.approx(1e-11)
    for n in range(1, 12):
        work.observe(4e-11 * 1e8, 10**8)  # the CPU got 4x slower at experts (another request's work, say)
        if n >= 10:
            assert work.e.value == pytest.approx(4e-11, rel=0.05)
    work.observe(0.0, 10**8)  # not a measurement
    assert work.e.value == pytest.approx(4e-11, rel=0.05)


def test_r_accounts_for_the_expected_expert_work():
    rf = Roofline(a=2e-8, b=2e-8, c_cpu=0.0, c_gpu=0.0)
    pol = WriteScopePolicy(rf)
    pol.expect_batch(16)
    kv_only = pol.cpu_share(32768)
    assert kv_only == pytest.approx(0.5)
    pol.experts = ExpertWork(e=1e-11, g=2e-11, host_fraction=0.5, expert_bytes=10**7, num_experts=128, top_k=8, policy=pol)
    # the expert phase runs after the attention today: each phase is balanced apart, r(L) is the KV-only one
    assert not pol.experts.overlap and pol.cpu_share(32768) == kv_only
    pol.experts.balance = "alone"  # nor with the expert phase balanced alone
    assert not pol.experts.overlap and pol.cpu_share(32768) == kv_only
    pol.experts.balance = "joint"  # an expert phase beside the attention: the joint model
    assert pol.experts.expected_bytes(16) == pytest.approx(expected_hit_experts(16, 128, 8) * 0.5 * 10**7)
    joint = pol.cpu_share(32768)
    assert joint < kv_only  # the CPU also computes host experts, so it takes less KV
    r, s = joint_split(16 * 32768, pol.experts.expected_bytes(16), pol.experts.costs())
    assert joint == pytest.approx(r) and s == 0.0


def _blocks(llm):
    from writescope.moe.block import SparseMoeBlock

    return [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]


def _half_on_host_llm(share=None):
    from writescope import LLM

    half = half_experts_budget()  # half the experts on the host, with slots
    return LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, vram_budget=half, max_batch=2, expert_stream_share=share)


def test_writescope_splits_host_experts_each_step_with_the_same_tokens(monkeypatch):
    import writescope.scheduler.expert_work as expert_work

    monkeypatch.setattr(expert_work, "PROBE_EVERY", 10**9)  # no CPU probe: a free link streams every expert
    prompts = [[5, 6, 7] * 12, [8, 9] * 20]
    ref = _half_on_host_llm()
    want = [o.token_ids for o in ref.generate(prompt_token_ids=prompts)]
    assert ref.expert_work is None  # static policy: the fixed share
    llm = _half_on_host_llm()
    seen = {}
    for name, b in (("cheap link", 1e-15), ("dear link", 1e-3)):
        llm.set_policy("writescope", roofline=Roofline(a=1e-9, b=b, c_cpu=0.0, c_gpu=0.0))
        work = llm.expert_work
        assert work is not None and all(blk.expert_work is work for blk in _blocks(llm) if blk.host_experts)
        assert "joint roofline" in llm.host_experts_in_decode()
        outs = llm.generate(prompt_token_ids=prompts)
        assert [o.token_ids for o in outs] == want, name
        trace = llm.r_trace
        seen[name] = (sum(p.get("experts_streamed", 0) for p in trace), sum(p.get("experts_cpu", 0) for p in trace))
        assert work.observed and work.x.value > 0
    assert seen["cheap link"][0] > 0 and seen["cheap link"][1] == 0  # a free link streams every few-token host expert
    assert seen["dear link"][0] == 0 and seen["dear link"][1] > 0  # a slow one leaves them to the CPU
    fixed = _half_on_host_llm(share=1.0)
    fixed.set_policy("writescope", roofline=Roofline(a=1e-9, b=1e-3, c_cpu=0.0, c_gpu=0.0))
    assert fixed.expert_work is None and fixed.policy.experts is None  # --expert-stream-share: the fixed baseline


def test_the_expert_stream_share_is_set_and_given_back_on_a_loaded_model():
    """``LLM.set_expert_stream_share``: a fixed share detaches the joint split (every block takes
    it, the same tokens), None gives the choice back to ``writescope``; a bad share or a running
    request changes nothing."""
    from writescope.errors import ArgError

    prompts = [[5, 6, 7] * 12, [8, 9] * 20]
    llm = _half_on_host_llm()
    llm.set_policy("writescope", roofline=Roofline(a=1e-9, b=1e-3, c_cpu=0.0, c_gpu=0.0))
    want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts)]
    assert llm.expert_work is not None and llm.expert_stream_share_given is None
    llm.set_expert_stream_share(0.5)
    assert llm.expert_work is None and llm.policy.experts is None and llm.expert_stream_share_given == 0.5
    assert {b.stream_share for b in _blocks(llm)} == {0.5} and llm.expert_stream_share == 0.5
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts)] == want
    for bad in (-0.1, 1.5, float("nan"), "auto", "0.5", True):
        with pytest.raises(ArgError, match="expert_stream_share must be a number in"):
            llm.set_expert_stream_share(bad)
    assert llm.expert_stream_share_given == 0.5
    llm.set_expert_stream_share(None)
    assert llm.expert_work is not None and llm.policy.experts is llm.expert_work and llm.expert_stream_share_given is None
    def failing():
        for b in _blocks(llm):  # as attach_expert_work does first
            b.expert_work = None
        llm.policy.experts = None
        raise RuntimeError("measuring failed")

    work, link = llm.expert_work, llm.other_work.link_seconds
    llm._attach_expert_work = failing  # an attach that fails: everything as before
    with pytest.raises(RuntimeError, match="measuring failed"):
        llm.set_expert_stream_share(1.0)
    assert llm.expert_stream_share_given is None and {b.stream_share for b in _blocks(llm)} == {0.0}
    assert llm.expert_work is work and llm.policy.experts is work and llm.other_work.link_seconds is link
    assert all(b.expert_work is work for b in _blocks(llm) if b.host_experts)
    del llm._attach_expert_work
    llm.set_expert_stream_share(1.0, attach=False)  # detached until set_policy attaches (a fixed share: none)
    assert llm.expert_work is None and llm.policy.experts is None and all(b.expert_work is None for b in _blocks(llm))
    llm.set_expert_stream_share(None)
    assert llm.expert_work is not None
    slot = llm.cache.allocate(64)  # a request holding KV
    with pytest.raises(ValueError, match="while 1 request run"):
        llm.set_expert_stream_share(0.0)
    assert llm.expert_work is not None and {b.stream_share for b in _blocks(llm)} == {0.0}  # as before (the CPU's default)
    llm.cache.free(slot)


def test_a_bench_row_sets_its_own_expert_stream_share():
    """``POLICY@expert_stream_share=S`` (bench/switches.py): the row runs with that share and the
    next row with the run's own; bad values fail the check before any work."""
    from writescope.bench import switches
    from writescope.bench.runner import BenchConfig, run_one

    assert switches.settings({"expert_stream_share": "0.25", "WRITESCOPE_MICRO_BATCHES": "2"}) == (
        {"WRITESCOPE_MICRO_BATCHES": "2"}, {"expert_stream_share": 0.25})
    assert switches.settings({"expert_stream_share": "Auto"})[1] == {"expert_stream_share": None}
    switches.check("writescope@expert_stream_share=1")
    for bad in ("2", "x", "nan", ""):
        with pytest.raises(ValueError, match="give the share of decode's host experts streamed to the GPU, in \\[0, 1\\]"):
            switches.check(f"writescope@expert_stream_share={bad}")
    with pytest.raises(ValueError, match="or expert_stream_share"):
        switches.check("writescope@EXPERT_SHARE=1")
    llm = _half_on_host_llm()
    seen = []
    original = llm.set_expert_stream_share

    def recording(share, attach=True):
        original(share, attach)
        seen.append((share, {b.stream_share for b in _blocks(llm)}))

    llm.set_expert_stream_share = recording
    rf = Roofline(a=1e-9, b=1e-3, c_cpu=0.0, c_gpu=0.0)  # a slow link: writescope would split
    cfg = BenchConfig([2], [40], ["writescope@expert_stream_share=1"], steps=2, window=16, warmup=False, kv_fill="random")
    row = run_one(llm, cfg, 2, 40, "writescope@expert_stream_share=1", roofline=rf)
    assert row.fits and row.tpot_ms > 0 and row.extra["switches"] == {"expert_stream_share": "1"}
    assert seen == [(1.0, {1.0})] and llm.expert_work is None
    assert "expert_split" not in row.extra  # a fixed share: no per-step split
    row = run_one(llm, cfg, 2, 40, "writescope", roofline=rf)  # the next row: the run's own share (None: the CPU's default 0)
    assert row.fits and seen == [(1.0, {1.0}), (None, {0.0})] and llm.expert_stream_share_given is None
    assert llm.expert_work is not None and "expert_split" in row.extra
    run_one(llm, cfg, 2, 40, "writescope", roofline=rf)
    assert len(seen) == 2  # already the run's share: not set again


def test_a_share_is_any_real_number_in_range():
    from fractions import Fraction

    import numpy as np

    from writescope.engine.arguments import check_share
    from writescope.errors import ArgError

    for ok in (None, 0, 1, 0.5, np.float32(0.25), Fraction(1, 3)):
        check_share(ok)
    for bad in (True, "0.5", "auto", np.float64("nan"), 2, -1e-9):
        with pytest.raises(ArgError, match="expert_stream_share must be a number in \\[0, 1\\], or None"):
            check_share(bad)


def test_a_share_where_no_expert_is_on_the_host_is_warned_of():
    from writescope import LLM

    llm = LLM("tiny-qwen3-moe", progress=False)
    with pytest.warns(UserWarning, match="expert_stream_share=0.5 changes nothing here: no routed experts are in host memory"):
        llm.set_expert_stream_share(0.5)
    assert llm.expert_stream_share_given == 0.5


def test_a_bench_row_records_the_joint_expert_split():
    """A ``writescope`` row with the per-step expert split records, per decode step, the hit host
    experts streamed and computed on the CPU and the rates balanced (a slow link: all on the CPU),
    and the report prints them."""
    from writescope.bench.report import format_expert_split
    from writescope.bench.runner import BenchConfig, run_one

    llm = _half_on_host_llm()
    cfg = BenchConfig([2], [40], ["writescope"], steps=3, window=16, warmup=False, kv_fill="random")
    row = run_one(llm, cfg, 2, 40, "writescope", roofline=Roofline(a=1e-9, b=1e-3, c_cpu=0.0, c_gpu=0.0))
    x = row.extra["expert_split"]
    assert x["steps"] == 3 and x["streamed_per_step"] == 0 and x["cpu_per_step"] > 0
    assert x["streamed_steps"] == [0] * 3  # each decode step's, in order
    assert x["cpu_gbs"] > 0 and x["link_gbs"] == pytest.approx(1e-9 / (1e-3 / llm.config.kv_layout.bytes_per_token(4)))
    text = format_expert_split([row])
    assert text.startswith("the joint roofline's expert split") and "batch 2 context 40 writescope: 0.0 streamed" in text
    assert x["cpu_call_ms"] >= 0 and "ms a call" in text
    assert x["expected"] is False and "expected counts" not in text  # counted on the host (the old path, fp32 here)
    row.extra["expert_split"] = dict(x, expected=True)  # as the native expert worker's rows record it
    assert "; expected counts, uniform routing: the split is made on the device" in format_expert_split([row])
    assert x["link_samples"] == 0 and "in-step" not in text  # no timings of the link (no CUDA): G from attach
    row.extra["expert_split"] = dict(x, link_gbs=21.0, link_samples=12, link_attach_gbs=43.0, link_kv_gbs=55.6, link_read_gbs=43.0)
    assert ("G 21.0 GB/s tracked over 12 in-step timings of the in-place read; at attach 43.0, the slower of the KV "
            "copies' 55.6 and the fused kernels' in-place read 43.0)") in format_expert_split([row])
    row.extra["expert_split"] = dict(x, link_samples=0, link_issue_bound=5)
    assert "; 5 in-step timings left out: the device waited for the issuing thread)" in format_expert_split([row])
    assert format_expert_split([]) == ""


def test_the_expert_split_is_chosen_in_decode_only_and_balances_the_expert_phase():
    class Decoder:
        last_split = None

    rf = Roofline(a=2e-8, b=2e-8, c_cpu=0.0, c_gpu=0.0)
    pol = WriteScopePolicy(rf)
    dec = Decoder()
    work = ExpertWork(e=1 / 70e9, g=1 / 52e9, host_fraction=0.5, expert_bytes=10**7, num_experts=128, top_k=8, decoder=dec, policy=pol)
    assert work.choose([10**7] * 10) is None and not work.observed  # a prefill: the block's fixed share
    work.observe(1.0, 10**7)
    assert work.e.value == pytest.approx(1 / 70e9)  # nor is E fed from a prefill
    dec.last_split = (16 * 32768, 16 * 32768)  # a decode step whose KV split both sides are done with
    dec.last_early_tokens = 0  # no early copies: the thread issues the next layer's copies after the experts
    assert work.balance == "phase"
    k = work.choose([10**7] * 10)
    assert k == streamed_count([10**7] * 10, 0.0, 0.0, work.costs()) and 0 < k < 10  # the expert phase alone
    assert work.observed and work.x.value == pytest.approx(1e8)  # seeded with the first sample, not averaged from 0
    alone = k
    # split on the device (the thread runs ahead and issues the next layer's copies): the whole load region, the
    # buffers' cap unknown (10 ms of KV on the link: every expert to the CPU) ...
    assert pol.prefetch_tokens is None and work.choose([10**7] * 10, on_device=True) == 0
    pol.prefetch_tokens = 16384  # ... or as far as the buffers reach: 16384 tokens, 0.33 ms of the link's time
    k = work.choose([10**7] * 10, on_device=True)
    assert k == streamed_count([10**7] * 10, 0.0, 16384 * 2e-8, work.costs()) and 0 < k < alone
    dec.last_early_tokens = 8192  # copied early at the end of the load part: what the link does, whatever the path
    assert work.choose([10**7] * 10) == work.choose([10**7] * 10, on_device=True) == streamed_count(
        [10**7] * 10, 0.0, 8192 * 2e-8, work.costs())
    work.balance = "alone"  # the expert phase balanced as if the link had nothing else to do
    assert work.choose([10**7] * 10, on_device=True) == alone
    with pytest.raises(ValueError, match="expert balance 'both'"):
        work.balance = "both"
    assert work.balance == "alone"
    work.balance = "joint"  # with the phases overlapping, the KV already on each side counts
    assert work.choose([10**7] * 10) == streamed_count([10**7] * 10, 16 * 32768 * 2e-8, 16 * 32768 * 2e-8, work.costs())


def _h200_link(llm) -> Roofline:
    """A roofline whose link carries 55 GB/s (the H200 machine's host-to-GPU rate)."""
    return Roofline(a=1e-9, b=llm.config.kv_layout.bytes_per_token(llm.dtype.itemsize) / 55e9, c_cpu=0.0, c_gpu=0.0)


def test_writescope_reads_host_experts_in_place_where_the_fused_kernels_can(monkeypatch):
    """Where every hosted block reads its hit host experts in place (the fused decode kernels on
    CUDA) and that is expected to be faster than the split (tiny experts: the split's overhead per
    layer decides), ``writescope`` attaches no per-step expert split (r(L) is the KV-only one) and
    says so; where one block cannot, the split stays; over a link slow enough that reading the
    experts in place takes longer than the split, the split is attached and says why."""
    from writescope.moe.block import SparseMoeBlock

    llm = _half_on_host_llm()
    rf = _h200_link(llm)
    monkeypatch.setattr(SparseMoeBlock, "reads_host_experts_in_place", lambda self, tokens=None: True)
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work is None and llm.policy.experts is None
    assert all(b.expert_work is None for b in _blocks(llm))
    assert llm.host_experts_in_decode() == "host experts read in place over PCIe by the fused decode kernels"
    llm.set_policy("writescope", roofline=Roofline(a=1e-9, b=1e-3, c_cpu=0.0, c_gpu=0.0))  # 1 ms a KV token: a slow link
    assert llm.expert_work is not None and all(b.expert_work is llm.expert_work for b in _blocks(llm) if b.host_experts)
    words = llm.host_experts_in_decode()
    assert "joint roofline" in words and "read in place over PCIe below" in words and "at 2 tokens the expert phase" in words
    below = llm.expert_work.in_place_below
    assert 1 <= below <= 2 and f"split from {below} token{'s' if below > 1 else ''} a decode step" in words
    first = next(b for b in _blocks(llm) if b.host_experts)
    monkeypatch.setattr(SparseMoeBlock, "reads_host_experts_in_place", lambda self, tokens=None: self is not first)
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work is not None and "joint roofline" in llm.host_experts_in_decode()
    assert llm.expert_work.why == ""  # not chosen over the in-place read: one block cannot read in place


def test_the_expert_phase_model_of_the_in_place_read_and_the_split():
    """In place: every hit expert's bytes at the link's rate; split: whole experts balanced
    between the CPU and the link, averaged over the binomial count of hits, plus the overhead per
    layer with host experts; the figures of run 34's Mixtral and run 18's Qwen3 pick as measured."""
    from writescope.scheduler.expert_work import SPLIT_OVERHEAD_S, LayerHits, expert_phase_seconds

    e, g = 1 / 75e9, 1 / 55e9
    s = 1e9
    # every host expert always hit (p 1): the split is the whole-expert balance of that many, exactly
    in_place, split = expert_phase_seconds([LayerHits(1, 1.0, s), LayerHits(0, 0.5, s), LayerHits(2, 1.0, s)], e, g, overhead=1e-3)
    assert in_place == pytest.approx(3 * s * g)
    # one expert: the faster side alone (the CPU here); two: one on each side, the link the slower
    assert split == pytest.approx(s * e + s * g + 2e-3)  # the empty layer pays no overhead
    assert expert_phase_seconds([], e, g) == (0.0, 0.0)
    # p < 1: averaged over the binomial count of hits (0, 1 or 2 of 2)
    p = 0.3
    in_place, split = expert_phase_seconds([LayerHits(2, p, s)], e, g, overhead=0.0)
    assert in_place == pytest.approx(2 * p * s * g)
    assert split == pytest.approx(2 * p * (1 - p) * s * e + p * p * s * g)
    mixtral = [LayerHits(6, 1 - (1 - 2 / 8) ** 4, 352_321_536)] * 32  # 185 of 256 on the host, 4 tokens
    qwen3 = [LayerHits(64, 1 - (1 - 8 / 128) ** 4, 9_437_184)] * 48  # half on the host, 4 tokens
    assert expert_phase_seconds(mixtral, e, g)[1] < expert_phase_seconds(mixtral, e, g)[0]  # split (433 vs 961 ms measured)
    assert expert_phase_seconds(qwen3, e, g)[0] < expert_phase_seconds(qwen3, e, g)[1]  # in place (304 vs 428 ms measured)
    assert expert_phase_seconds([LayerHits(1, 1.0, s)], e, g)[1] == pytest.approx(s * e + SPLIT_OVERHEAD_S)  # the default overhead
    for bad in ((0.0, g), (e, float("inf")), (float("nan"), g)):
        with pytest.raises(ValueError, match="positive and finite"):
            expert_phase_seconds([LayerHits(1, 1.0, 1)], *bad)
    for layer in (LayerHits(1, float("nan"), 1), LayerHits(1, 1.5, 1), LayerHits(-1, 0.5, 1), LayerHits(1, 0.5, -1)):
        with pytest.raises(ValueError, match="p in \\[0, 1\\]"):
            expert_phase_seconds([layer], e, g)
    with pytest.raises(ValueError, match=">= 0"):
        expert_phase_seconds([LayerHits(1, 1.0, 1)], e, g, overhead=-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        expert_phase_seconds([LayerHits(1, 1.0, 1)], e, g, call=float("nan"))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 16, 17, 64])
@pytest.mark.parametrize("e, g, call", [(1 / 75e9, 1 / 55e9, 0.0), (1 / 30e9, 1 / 55e9, 0.0), (1 / 75e9, 1 / 20e9, 2e-4),
                                        (1 / 90e9, 1 / 45e9, 5e-3)])
def test_the_whole_expert_split_is_the_best_of_every_count_on_the_cpu(n, e, g, call):
    """whole_split_seconds's few candidates against a scan of every j on the CPU."""
    from writescope.scheduler.expert_work import whole_split_seconds

    s = 9_437_184
    scan = min(max(j * s * e + (call if j else 0.0), (n - j) * s * g) for j in range(n + 1))
    assert whole_split_seconds(n, s, e, g, call) == pytest.approx(scan, rel=1e-12, abs=0.0)


def test_the_worker_path_overhead_reads_one_small_host_expert_a_layer_in_place():
    """The split on the native expert worker (ASYNC_SPLIT_OVERHEAD_S), at run 60's rates: the CPU
    computing DeepSeek-V2-Lite's one host expert a MoE layer (26 layers, 17.3 MB each, hit in about
    79% of layer steps at 16 tokens; E 40.9, G 30.4 GB/s) cost 31-40 ms a step against reading it in
    place, so the model must read it in place at 16 and 32 tokens; Qwen3-30B-A3B 4 x 8K (138 MB of
    hit host experts a layer step, E 85, G 38 GB/s), where the CPU computing them was 40-56 ms a
    step faster, must still split. In whole experts even the estimate it replaced (0.3 ms) reads
    DSV2's in place: one expert goes to one side, so the split gains at most the gap between the
    two rates, not the divisible balance that picked the split (and lost) in run 60."""
    from writescope.scheduler.expert_work import ASYNC_SPLIT_OVERHEAD_S, LayerHits, expert_phase_seconds, split_from

    dsv2 = _fake_blocks(26, 64, 6, 1, 3 * 2048 * 1408 * 2)
    e, g = 1 / 40.9e9, 1 / 30.4e9
    assert split_from(dsv2, 32, e, g, ASYNC_SPLIT_OVERHEAD_S) is None
    assert split_from(dsv2, 32, e, g, 0.3e-3) is None
    assert split_from(dsv2, 32, e, g, 0.05e-3) is not None  # a smaller overhead would take the faster CPU
    qwen3 = [LayerHits(64, 1 - (1 - 8 / 128) ** 4, 9_437_184)] * 48  # about 138 MB hit a layer step
    in_place, split = expert_phase_seconds(qwen3, 1 / 85e9, 1 / 38e9, ASYNC_SPLIT_OVERHEAD_S)
    assert split < in_place


def _fake_blocks(layers, num_experts, top_k, on_host, expert_bytes):
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_experts=num_experts, top_k=top_k)
    return [SimpleNamespace(host_experts=set(range(on_host)), cfg=cfg, host_pack=SimpleNamespace(expert_nbytes=expert_bytes))
            for _ in range(layers)]


def test_the_split_starts_at_the_fewest_tokens_where_it_wins():
    """Qwen3-30B-A3B with half its experts on the host: the in-place read up to a few tokens, the
    split from some count past 4 (run 18 measured the in-place read faster at 4); Mixtral-8x7B
    (185 of 256 on the host): the split from the first token; a budget of tokens below the first
    win: None. The answer is the first count at which the split wins (bisection checked against
    a scan)."""
    from writescope.scheduler.expert_work import expert_phase_seconds, layer_hits, split_from

    e, g = 1 / 75e9, 1 / 55e9
    qwen3 = _fake_blocks(48, 128, 8, 64, 3 * 2048 * 768 * 2)
    first = split_from(qwen3, 64, e, g)
    assert first is not None and 4 < first <= 64
    scan = next(t for t in range(1, 65) if (lambda p: p[1] < p[0])(
        expert_phase_seconds([layer_hits(b, t) for b in qwen3], e, g)))
    assert first == scan
    assert split_from(qwen3, first - 1, e, g) is None and split_from(qwen3, 0, e, g) is None
    mixtral = _fake_blocks(32, 8, 2, 6, 3 * 4096 * 14336 * 2)
    assert split_from(mixtral, 4, e, g) == 1


def test_a_pass_below_the_split_s_threshold_reads_host_experts_in_place(monkeypatch):
    """With the split attached from N tokens, a block's passes of fewer tokens take the in-place
    read (configured as before), passes of N or more the split; without a threshold every pass splits."""
    from types import SimpleNamespace

    from writescope.moe import fused_decode
    from writescope.moe.block import SparseMoeBlock

    monkeypatch.setattr(fused_decode, "env_fused", lambda: True)
    llm = _half_on_host_llm(share=1.0)
    b = next(blk for blk in _blocks(llm) if blk.host_experts)
    monkeypatch.setattr(SparseMoeBlock, "why_not_streamed", lambda self: None)
    assert b._host_in_place_configured(3) and b._host_in_place_configured(None)
    b.expert_work = SimpleNamespace(in_place_below=4)
    assert [b._host_in_place_configured(t) for t in (1, 3, 4, 16, None)] == [True, True, False, False, False]
    b.expert_work = SimpleNamespace(in_place_below=0)
    assert not b._host_in_place_configured(1)


def test_the_real_in_place_check_decides_whether_writescope_splits(monkeypatch):
    """The blocks' own check (no stand-in): an fp16 model with half its experts on the host and
    every hit host expert streamed (CUDA's default share), the fused kernels asked for (the check
    only: no kernel runs here). writescope attaches no split; it does with the ``grouped``
    switch, with a ``max_batch`` whose decode steps could exceed the kernels' row limit, but not
    after a move dropped the blocks' packs."""
    import writescope.engine.llm as engine
    from writescope import LLM
    from writescope.moe import fused_decode
    from writescope.presets import preset_config

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("WRITESCOPE_MOE_KERNEL", "fused")
    monkeypatch.setenv("WRITESCOPE_GPU_ATTENTION", "torch")  # no attention kernel in this process's (non-interpreted) Triton
    monkeypatch.setattr(fused_decode, "triton", fused_decode.triton or object())
    monkeypatch.setattr(engine, "default_stream_share", lambda device: 1.0)
    cfg = preset_config("tiny-qwen3-moe")
    half = half_experts_budget(dtype=torch.float16)
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, vram_budget=half, max_batch=2, dtype="fp16")
    rf = _h200_link(llm)
    in_place = "host experts read in place over PCIe by the fused decode kernels"
    assert llm.host_experts_in_decode() == in_place  # static:0.5: no split to attach either way
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work is None and llm.host_experts_in_decode() == in_place
    monkeypatch.setenv("WRITESCOPE_MOE_KERNEL", "grouped")
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work is not None and "joint roofline" in llm.host_experts_in_decode()
    monkeypatch.setenv("WRITESCOPE_MOE_KERNEL", "fused")
    llm.max_batch = fused_decode.MAX_ROWS // cfg.moe.top_k + 1  # a step of this many tokens takes the copies
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work is not None
    llm.max_batch = 2
    llm.model.to(llm.device)  # drops every block's pack until the next forward
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work is None and llm.host_experts_in_decode() == in_place


def test_g_is_the_slower_of_the_kv_copies_and_the_in_place_read(monkeypatch):
    """Where the link's share of the host experts is read in place by the fused kernels (the
    asynchronous path), G is measured there at attach and the slower of it and the KV copies'
    rate counts; the host path (copies) keeps the KV copies' rate and measures nothing."""
    import writescope.scheduler.expert_work as expert_work
    from writescope.moe.block import SparseMoeBlock

    llm = _half_on_host_llm()
    rf = _h200_link(llm)
    g_kv = rf.b / llm.config.kv_layout.bytes_per_token(llm.dtype.itemsize)
    measured = []

    def measure(block, value):
        measured.append(block)
        return value

    monkeypatch.setattr(SparseMoeBlock, "takes_async", lambda self, dtype, device, tokens=None: True)
    for read, want in ((10 * g_kv, 10 * g_kv), (0.1 * g_kv, g_kv), (None, g_kv)):
        monkeypatch.setattr(expert_work, "measure_link_expert_cost", lambda block, v=read: measure(block, v))
        llm.set_policy("writescope", roofline=rf)
        work = llm.expert_work
        assert measured.pop() in _blocks(llm) and not measured
        assert work.g == pytest.approx(want) and work.g_kv == pytest.approx(g_kv) and work.g_read == read
    monkeypatch.setattr(SparseMoeBlock, "takes_async", lambda self, dtype, device, tokens=None: False)
    llm.set_policy("writescope", roofline=rf)
    assert not measured and llm.expert_work.g == pytest.approx(g_kv) and llm.expert_work.g_read is None
    # where the blocks read their host experts in place (the fused kernels), the measured read decides that too: over
    # the KV copies' rate reading in place wins (no split); over a read measured a million times slower the split does
    monkeypatch.setattr(SparseMoeBlock, "takes_async", lambda self, dtype, device, tokens=None: True)
    monkeypatch.setattr(SparseMoeBlock, "reads_host_experts_in_place", lambda self, tokens=None: True)
    monkeypatch.setattr(expert_work, "measure_link_expert_cost", lambda block: None)
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work is None
    monkeypatch.setattr(expert_work, "measure_link_expert_cost", lambda block: 1e6 * g_kv)
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work is not None and llm.expert_work.g == pytest.approx(1e6 * g_kv) and "read in place" in llm.expert_work.why

    def broken(block):
        raise Exception("a Triton error")  # not a RuntimeError

    monkeypatch.setattr(expert_work, "measure_link_expert_cost", broken)
    monkeypatch.setattr(SparseMoeBlock, "reads_host_experts_in_place", lambda self, tokens=None: False)
    with pytest.warns(UserWarning, match="could not measure the fused kernels' in-place read"):
        llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work.g == pytest.approx(g_kv) and llm.expert_work.g_read is None
    monkeypatch.undo()
    assert expert_work.measure_link_expert_cost(next(b for b in _blocks(llm) if b.host_experts)) is None  # no CUDA here


def test_the_expert_balance_switch_chooses_the_model(monkeypatch):
    """``WRITESCOPE_EXPERT_BALANCE``: ``phase`` (the default) balances each expert phase with the
    link's copies ahead, ``alone`` without them, ``joint`` counts the step's KV on each side with its experts (``overlap``); read when the
    split is attached (a bench row's switch), a bad value refused naming it."""
    from writescope.scheduler.expert_work import BALANCE_ENV, balance_from_env

    llm = _half_on_host_llm()
    rf = Roofline(a=1e-9, b=1e-9, c_cpu=0.0, c_gpu=0.0)
    monkeypatch.delenv(BALANCE_ENV, raising=False)
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work is not None and llm.expert_work.balance == "phase" and not llm.expert_work.overlap
    monkeypatch.setenv(BALANCE_ENV, "alone")
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work.balance == "alone" and not llm.expert_work.overlap
    monkeypatch.setenv(BALANCE_ENV, "joint")
    llm.set_policy("writescope", roofline=rf)
    assert llm.expert_work.balance == "joint" and llm.expert_work.overlap
    monkeypatch.setenv(BALANCE_ENV, "both")
    with pytest.raises(ValueError, match="WRITESCOPE_EXPERT_BALANCE='both'"):
        balance_from_env()
