"""O in the balance of r(L), and the in-step A kept for the next policy's prefill
(writescope/scheduler/roofline.py, writescope/scheduler/other_work.py)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from writescope.engine.threads import usable_cpus
from writescope.kvcache.spec import Roofline
from writescope.scheduler import other_work as ow
from writescope.scheduler.roofline import LINK_FIXED, OnlineEstimate, WriteScopePolicy, link_in_other, roofline_share

# the calibration of the H200 DeepSeek-V2-Lite 16 x 32K run (benchmarks/results/gpu_decode_h200_run25_variants_dsv2_16x32k.json)
DSV2 = Roofline(a=1.5929e-08, b=2.0028e-08, c_cpu=4.714e-04, c_gpu=0.0, b_alone=2.0412e-08, c_gpu_alone=3.182e-04)
PLACED = 32768 - 256  # tokens per sequence outside the D-window
O, O_LINK = 1.0e-3, 0.2e-3  # seconds per decode layer step at batch 16


class Meter:
    """An :class:`~writescope.scheduler.other_work.OtherWork` stand-in: fixed O and O_link at
    every batch, nothing kept."""

    def __init__(self, o: float | None = O, link: float = O_LINK):
        self.o, self.o_link = o, link

    def seconds(self, batch: int, path: str | None = None) -> float | None:
        return self.o

    def link(self, batch: int) -> float:
        return self.o_link

    def in_step_a(self, threads: int) -> float | None:
        return None

    def in_step_c(self, threads: int, batch: int) -> float | None:
        return None


def _policy(meter, micro_batches: int = 1, batch: int = 16, roofline: Roofline = DSV2, prefetch_tokens=None) -> WriteScopePolicy:
    p = WriteScopePolicy(roofline)
    p.attach(meter, attention_threads=15, micro_batches=micro_batches, prefetch_tokens=prefetch_tokens)
    p.expect_batch(batch)
    return p


# ------------------------------------------------------------------ O in the balance
def test_o_goes_on_the_cpu_side_and_o_link_on_the_link_side_of_the_balance():
    L = 16 * PLACED
    r = _policy(Meter()).cpu_share(PLACED)
    assert r == pytest.approx(roofline_share(L, DSV2.a, DSV2.b, DSV2.c_cpu + O, DSV2.c_gpu + O_LINK), rel=1e-12)
    # both sides finish together: the CPU part waits behind O, the link streams during it
    assert O + r * DSV2.a * L + DSV2.c_cpu == pytest.approx((1 - r) * DSV2.b * L + DSV2.c_gpu + O_LINK, rel=1e-9)
    # the measured run: r = 0.531 deployed without O; with O (and no link inside it) about 0.48 at the
    # calibration's A, 0.43-0.45 at the A seen inside decode steps (17-20 ns/token)
    assert roofline_share(L, DSV2.a, DSV2.b, DSV2.c_cpu, DSV2.c_gpu) == pytest.approx(0.531, abs=0.002)
    assert _policy(Meter(link=0.0)).cpu_share(PLACED) == pytest.approx(0.478, abs=0.002)
    in_step = _policy(Meter(link=0.0), roofline=Roofline(**{**vars(DSV2), "a": 18.5e-9})).cpu_share(PLACED)
    assert 0.43 <= in_step <= 0.45


@pytest.mark.parametrize("o", [0.1e-3, 0.5e-3, 1.0e-3, 3.0e-3])
@pytest.mark.parametrize("batch", [4, 16, 32])
def test_o_lowers_the_share(o, batch):
    without = _policy(Meter(o=None), batch=batch).cpu_share(PLACED)  # not measured: eq. 2 alone
    assert without == pytest.approx(roofline_share(batch * PLACED, DSV2.a, DSV2.b, DSV2.c_cpu, DSV2.c_gpu))
    with_o = _policy(Meter(o=o, link=0.0), batch=batch).cpu_share(PLACED)
    assert with_o < without
    # O_link as large as O on the link side: the two cancel in the balance
    assert _policy(Meter(o=o, link=o), batch=batch).cpu_share(PLACED) == pytest.approx(without, rel=1e-12)


# the calibration of the H200 Qwen3-30B-A3B 16 x 32K run 36 (benchmarks/results/gpu_decode_h200_run36_variants_qwen3_16x32k.json),
# its O (8.57 ms a layer step) and the ring of two 64 MiB ping-pong buffers: 256 blocks of 256 tokens of 2,048 bytes
QWEN3 = Roofline(a=2.7474e-08, b=3.7591e-08, c_cpu=1.8977e-04, c_gpu=5.3250e-04, b_alone=3.8068e-08, c_gpu_alone=1.6858e-04)
QWEN3_O, QWEN3_RING = 8.57e-3, 2 * (64 * 2**20 // (256 * 2048)) * 256
# the link side's fixed cost where O is in the balance: QWEN3's calibrated C_gpu (0.53 ms) capped at
# LINK_FIXED (0.15 ms; writescope/scheduler/roofline.py says why: runs 40-41)
QWEN3_C_LINK = min(QWEN3.c_gpu, LINK_FIXED)


def test_the_link_works_ahead_during_o_only_as_far_as_the_ping_pong_buffers_reach():
    """Run 36: uncapped, O = 8.57 ms on the CPU side with nothing on the link's gave r = 0.33-0.35 and
    1,192 ms a step, where fixed shares of 0.5 and 0.6 took 880 and 844 ms; capped by the ring, the
    share comes back to about 0.5."""
    L = 16 * PLACED
    # what run 36 deployed, uncapped and with the calibrated C_gpu on the link's side: 0.334
    assert roofline_share(L, QWEN3.a, QWEN3.b, QWEN3.c_cpu + QWEN3_O, QWEN3.c_gpu) == pytest.approx(0.334, abs=0.003)
    # the policy now charges the link side's fixed cost at QWEN3_C_LINK (0.15 ms): eq. 2 gives 0.323
    # uncapped, 0.504 capped by the ring (0.515 with C_gpu in full)
    uncapped = _policy(Meter(o=QWEN3_O, link=0.0), roofline=QWEN3).cpu_share(PLACED)
    assert uncapped == pytest.approx(roofline_share(L, QWEN3.a, QWEN3.b, QWEN3.c_cpu + QWEN3_O, QWEN3_C_LINK), rel=1e-12)
    assert uncapped == pytest.approx(0.323, abs=0.003)
    capped = _policy(Meter(o=QWEN3_O, link=0.0), roofline=QWEN3, prefetch_tokens=QWEN3_RING).cpu_share(PLACED)
    assert capped == pytest.approx(0.504, abs=0.003)
    # both sides finish together: the link is idle for O less what the ring holds
    w = QWEN3_RING * QWEN3.b
    assert QWEN3_O + capped * QWEN3.a * L + QWEN3.c_cpu == pytest.approx(
        (1 - capped) * QWEN3.b * L + QWEN3_C_LINK + QWEN3_O - w, rel=1e-9)


@pytest.mark.parametrize("o_link", [0.0, 0.3e-3, 2.9e-3])
@pytest.mark.parametrize("ring", [0, 1, 4097, QWEN3_RING, 10**9])
def test_the_ring_s_cap_on_the_link_side(o_link, ring):
    L = 16 * PLACED
    o = 3.0e-3
    got = _policy(Meter(o=o, link=o_link), roofline=QWEN3, prefetch_tokens=ring).cpu_share(PLACED)
    link_side = max(o_link, o - ring * QWEN3.b)
    # the link side's fixed cost is QWEN3_C_LINK where O is in the balance (LINK_FIXED)
    assert got == pytest.approx(roofline_share(L, QWEN3.a, QWEN3.b, QWEN3.c_cpu + o, QWEN3_C_LINK + link_side), rel=1e-12)
    uncapped = _policy(Meter(o=o, link=o_link), roofline=QWEN3).cpu_share(PLACED)
    assert got >= uncapped - 1e-12  # the cap only takes link time away from the CPU's O
    if ring == 0:  # a load region read in place: nothing streams ahead, O is on both sides (and cancels)
        assert got == pytest.approx(roofline_share(L, QWEN3.a, QWEN3.b, QWEN3.c_cpu, QWEN3_C_LINK), rel=1e-9)
    if ring * QWEN3.b >= o - o_link:  # the ring holds all the link can do during O: no cap
        assert got == pytest.approx(uncapped, rel=1e-12)


def test_the_gate_caps_both_paths_by_the_ring():
    from writescope.scheduler.roofline import link_in_other, split_pays

    assert link_in_other(QWEN3_O, 0.0, None, QWEN3.b) == 0.0
    assert link_in_other(QWEN3_O, 1e-3, 0, QWEN3.b) == QWEN3_O
    assert link_in_other(QWEN3_O, 8e-3, QWEN3_RING, QWEN3.b) == 8e-3
    # 4 x 32K at r 0.5: uncapped, streaming alone hides its 4.9 ms of KV behind O and the split
    # cannot pay; with the ring's cap most of O is idle link time on both paths, and it does
    L, r = 4 * PLACED, 0.5
    assert not split_pays(L, r, QWEN3.a, QWEN3, QWEN3_O, 0.0)
    assert split_pays(L, r, QWEN3.a, QWEN3, QWEN3_O, 0.0, QWEN3_RING)
    t_cpu, t_gpu = r * QWEN3.a * L + QWEN3.c_cpu, (1 - r) * QWEN3.b * L + QWEN3.c_gpu
    split = max(QWEN3_O + max(t_cpu, QWEN3.c_gpu), t_gpu + QWEN3_O - QWEN3_RING * QWEN3.b)
    alone = max(QWEN3_O + QWEN3.c_gpu_alone, QWEN3.b_alone * L + QWEN3.c_gpu_alone + QWEN3_O - QWEN3_RING * QWEN3.b_alone)
    assert split < alone < split + 2e-3  # the capped forms, each path at its own rate


def test_the_link_side_s_fixed_cost_is_capped_where_o_is_in_the_balance(monkeypatch):
    """Where O is measured and the step is not micro-batched, the balance and the gate both charge the
    link side's fixed cost as min(C_gpu, LINK_FIXED); without O, and in micro-batched steps, the
    calibrated C_gpu stands; the policy's own roofline is not changed."""
    from writescope.scheduler import roofline as rl

    seen = []
    real = rl.split_pays
    monkeypatch.setattr(rl, "split_pays", lambda *a, **k: (seen.append(a[3]), real(*a, **k))[1])
    L, o = 16 * PLACED, 3.0e-3
    p = _policy(Meter(o=o, link=0.0), batch=16, roofline=QWEN3, prefetch_tokens=QWEN3_RING)
    r = p.cpu_share(PLACED)
    link_side = link_in_other(o, 0.0, QWEN3_RING, QWEN3.b)
    assert r == pytest.approx(roofline_share(L, QWEN3.a, QWEN3.b, QWEN3.c_cpu + o, LINK_FIXED + link_side), rel=1e-12)
    assert seen[-1].c_gpu == LINK_FIXED < QWEN3.c_gpu and seen[-1].c_gpu_alone == QWEN3.c_gpu_alone  # the gate's roofline
    assert p.roofline is QWEN3
    # two micro-batches: eq. 2 without O, and the gate with the calibrated C_gpu
    assert _policy(Meter(o=o, link=0.0), micro_batches=2, batch=16, roofline=QWEN3, prefetch_tokens=QWEN3_RING).cpu_share(
        PLACED) == pytest.approx(
        roofline_share(L, QWEN3.a, QWEN3.b, QWEN3.c_cpu, QWEN3.c_gpu), rel=1e-12)
    assert seen[-1] is QWEN3
    # O not measured: eq. 2 and the gate as calibrated
    assert _policy(Meter(o=None), batch=16, roofline=QWEN3).cpu_share(PLACED) == pytest.approx(
        roofline_share(L, QWEN3.a, QWEN3.b, QWEN3.c_cpu, QWEN3.c_gpu), rel=1e-12)
    assert seen[-1] is QWEN3
    # a calibrated C_gpu below the cap is kept
    low = Roofline(**{**vars(QWEN3), "c_gpu": 0.05e-3})
    assert _policy(Meter(o=o, link=0.0), batch=16, roofline=low, prefetch_tokens=QWEN3_RING).cpu_share(PLACED) == pytest.approx(
        roofline_share(L, low.a, low.b, low.c_cpu + o, low.c_gpu + link_side), rel=1e-12)
    assert seen[-1].c_gpu == low.c_gpu


@pytest.mark.parametrize("bad", [-1, float("nan")])
def test_a_negative_ring_is_refused(bad):
    with pytest.raises(ValueError, match="prefetch_tokens"):
        WriteScopePolicy(QWEN3).attach(Meter(), attention_threads=1, micro_batches=1, prefetch_tokens=bad)


def test_the_engine_gives_the_policy_its_cache_s_ring(monkeypatch):
    from writescope import LLM

    rf = Roofline(a=1e-3, b=1e-3)
    monkeypatch.delenv("WRITESCOPE_LOAD_READ", raising=False)
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16)
    llm.set_policy("writescope", roofline=rf)
    spec = llm.cache.spec
    assert llm.policy.prefetch_tokens == llm.cache.prefetch_tokens == spec.pingpong_total_bytes() // spec.token_bytes > 0
    monkeypatch.setenv("WRITESCOPE_LOAD_READ", "in-place")
    llm = LLM("tiny-qwen3-moe", progress=False, policy="writescope", window=16)
    assert llm.policy.prefetch_tokens == 0


def test_steps_split_into_two_micro_batches_keep_the_balance_without_o(monkeypatch):
    """With two micro-batches the CPU attends one half while the GPU runs the other half's O: O stays
    out of the balance (the gate still counts it); a batch of one is never split, so there it counts."""
    from writescope.scheduler import roofline as rl

    seen = []
    real = rl.split_pays
    monkeypatch.setattr(rl, "split_pays", lambda *a, **k: (seen.append(a[4:]), real(*a, **k))[1])
    L = 16 * PLACED
    assert _policy(Meter(), micro_batches=2).cpu_share(PLACED) == pytest.approx(
        roofline_share(L, DSV2.a, DSV2.b, DSV2.c_cpu, DSV2.c_gpu), rel=1e-12)
    assert seen[-1] == (O, O_LINK, None, 0.0)  # the gate as before (no WRITESCOPE_LINK_FIXED)
    one = _policy(Meter(), micro_batches=2, batch=1).cpu_share(16 * PLACED)
    assert one == pytest.approx(roofline_share(L, DSV2.a, DSV2.b, DSV2.c_cpu + O, DSV2.c_gpu + O_LINK), rel=1e-12)


def test_auto_keeps_o_out_of_the_balance_only_where_its_steps_split():
    """``WRITESCOPE_MICRO_BATCHES=auto``: the balance leaves O out in steps of fewer tokens than the
    policy's ``cpu_experts_from`` (or every step of two or more, with none), as two micro-batches
    do, and keeps it where the step runs whole, as one micro-batch does."""
    L = 16 * PLACED
    without_o = roofline_share(L, DSV2.a, DSV2.b, DSV2.c_cpu, DSV2.c_gpu)
    with_o = roofline_share(L, DSV2.a, DSV2.b, DSV2.c_cpu + O, DSV2.c_gpu + O_LINK)
    assert 0 < with_o < without_o < 1  # O moves the share: the cases below tell them apart
    auto = _policy(Meter(), micro_batches="auto")
    assert auto.cpu_experts_from is None and auto.cpu_share(PLACED) == pytest.approx(without_o, rel=1e-12)
    auto.cpu_experts_from = 17  # a 16-token step computes no host experts on the CPU: split
    assert auto.cpu_share(PLACED) == pytest.approx(without_o, rel=1e-12)
    auto.cpu_experts_from = 16  # from 16 tokens the CPU computes host experts: whole, O in the balance
    assert auto.cpu_share(PLACED) == pytest.approx(with_o, rel=1e-12)
    assert _policy(Meter(), micro_batches="auto", batch=1).cpu_share(16 * PLACED) == pytest.approx(with_o, rel=1e-12)


# the calibration of run 67's DSV2 4 x 32K rows (benchmarks/results/gpu_decode_h100_run67_variants_dsv2_4x32k.json)
RUN67 = Roofline(a=2.1258e-08, b=2.1101e-08, c_cpu=4.9453e-04, c_gpu=7.5270e-04, b_alone=2.0473e-08, c_gpu_alone=5.7047e-04)


def test_auto_falls_back_to_whole_steps_where_the_micro_batched_split_does_not_pay():
    """Run 67, DSV2 4 x 32K (O 0.77 ms a layer, read over the link): the gate refuses the
    micro-batched balance, so ``auto`` takes the whole-step share (O in the balance) and such a
    step runs whole (``splits_micro``); at 16 x 32K the micro-batched share pays and stands. The
    decision is made from the arguments alone each time: asking changes nothing."""
    meter = Meter(0.77e-3, 0.0)
    L4 = 4 * PLACED
    micro4 = roofline_share(L4, RUN67.a, RUN67.b, RUN67.c_cpu, RUN67.c_gpu)
    two = _policy(meter, micro_batches=2, batch=4, roofline=RUN67)
    assert micro4 > 0 and two.cpu_share(PLACED) == 0.0  # micro-batches always: the gate refuses its share
    auto = _policy(meter, micro_batches="auto", batch=4, roofline=RUN67)
    whole = _policy(meter, micro_batches=1, batch=4, roofline=RUN67).cpu_share(PLACED)
    assert 0 < whole < micro4
    assert auto.cpu_share(PLACED) == pytest.approx(whole, rel=1e-12)
    assert not auto.splits_micro(4, PLACED) and auto.splits_micro(16, PLACED)
    assert auto.cpu_share(64) == 0.0 and not auto.splits_micro(4, PLACED)  # a short placement asked in between changes nothing
    auto.expect_batch(16)  # a larger batch: the micro-batched share pays there
    assert auto.cpu_share(PLACED) == pytest.approx(roofline_share(16 * PLACED, RUN67.a, RUN67.b, RUN67.c_cpu, RUN67.c_gpu), rel=1e-12)
    assert auto.splits_micro(16, PLACED) and not auto.splits_micro(4, PLACED)
    auto.other = Meter(0.0, 0.0)  # no work outside attention: the micro-batched share pays at 4 too
    auto.expect_batch(4)
    assert auto.cpu_share(PLACED) == pytest.approx(micro4, rel=1e-12) and auto.splits_micro(4, PLACED)
    # where neither pays: r 0, and the configured rule stands (auto splits); 1 and 2 never fall back
    nothing = _policy(Meter(50e-3, 0.0), micro_batches="auto", batch=4, roofline=RUN67)
    assert nothing.cpu_share(64) == 0.0 and nothing.splits_micro(4, 64)
    assert two.splits_micro(4, PLACED) and not _policy(meter, batch=4, roofline=RUN67).splits_micro(4, PLACED)
    # asked at another batch than the one it tracks C_cpu at, it takes that batch's (here the
    # calibration's), not its own tracked one: as a policy at that batch would decide
    tracking = _policy(meter, micro_batches="auto", batch=16, roofline=RUN67)
    tracking.c = OnlineEstimate(0.25 * RUN67.c_cpu)
    fresh = _policy(meter, micro_batches="auto", batch=4, roofline=RUN67)
    low = _policy(meter, micro_batches="auto", batch=4, roofline=RUN67)
    low.c = OnlineEstimate(0.25 * RUN67.c_cpu)  # at its own batch the tracked C_cpu counts
    lengths = range(1024, 40960, 512)
    assert any(low.splits_micro(4, L) != fresh.splits_micro(4, L) for L in lengths)  # C_cpu decides somewhere here
    assert [tracking.splits_micro(4, L) for L in lengths] == [fresh.splits_micro(4, L) for L in lengths]


def test_the_engine_sets_where_auto_splits_on_the_cache_and_the_policy(monkeypatch):
    """With about half of the experts in host memory and the CPU computing their decode work
    (``expert_stream_share=0``), every step from one token computes host experts: the engine tells
    the cache and ``writescope`` so (1), and follows a policy change; with every expert on the
    device, none (None)."""
    from helpers import half_experts_budget
    from writescope import LLM

    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "auto")
    rf = Roofline(a=1e-3, b=1e-3)
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, max_batch=4,
              vram_budget=half_experts_budget("tiny-qwen3-moe", torch.float32, 4), expert_stream_share=0.0)
    assert any(b.host_experts for b in llm._moe_blocks)
    llm.set_policy("writescope", roofline=rf)
    assert llm.policy.micro_batches == "auto" and llm.policy.cpu_experts_from == 1 == llm.cache.cpu_experts_from
    llm.policy.cpu_experts_from = llm.cache.cpu_experts_from = 99
    llm.set_expert_stream_share(0.0, attach=False)  # a changed expert path refreshes both
    assert llm.policy.cpu_experts_from == 1 == llm.cache.cpu_experts_from
    plain = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16)
    plain.set_policy("writescope", roofline=rf)
    assert plain.policy.cpu_experts_from is None and plain.cache.cpu_experts_from is None


def test_the_engine_passes_its_cache_s_micro_batches_to_the_policy(monkeypatch):
    from writescope import LLM

    rf = Roofline(a=1e-3, b=1e-3)
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "2")
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16)
    llm.set_policy("writescope", roofline=rf)
    assert llm.cache.micro_batches == 2 and llm.policy.micro_batches == 2 and llm.policy.other is llm.other_work
    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES")
    llm.set_policy("writescope", roofline=rf)
    assert llm.policy.micro_batches == 1


# ------------------------------------------------------------------ the in-step A, kept
def test_a_policy_starts_from_the_a_an_earlier_one_observed(monkeypatch):
    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES", raising=False)
    meter = ow.OtherWork(torch.device("cpu"))
    first = _policy(meter)
    assert first.a.value == DSV2.a and first.in_step_a is None  # the calibration's A is not an in-step one
    meter.keep_in_step_a(15, first.in_step_a)
    assert meter.in_step_a(15) is None and meter.save() is None  # nothing kept, nothing to write
    for _ in range(12):  # decode steps' CPU parts at 19 ns/token
        first.observe(DSV2.c_cpu + 19e-9 * 100_000, 100_000, batch=16)
    assert first.in_step_a == pytest.approx(19e-9, rel=0.01)
    meter.keep_in_step_a(15, first.in_step_a)
    second = _policy(meter)
    assert second.a.value == first.in_step_a and second.in_step_a is None  # started from it, not yet observed
    assert second.cpu_share(PLACED) < _policy(ow.OtherWork(torch.device("cpu"))).cpu_share(PLACED)  # a slower A: less on the CPU
    # per CPU attention thread count: another count starts from calibration
    other_threads = WriteScopePolicy(DSV2)
    other_threads.attach(meter, attention_threads=7, micro_batches=1)
    assert other_threads.a.value == DSV2.a
    # per kernel switches, as O
    monkeypatch.setenv("WRITESCOPE_CPU_TUNING", "12")
    assert _policy(meter).a.value == DSV2.a
    monkeypatch.delenv("WRITESCOPE_CPU_TUNING")
    for bad in (float("nan"), float("inf"), 0.0, -1e-9):
        meter.keep_in_step_a(15, bad)
    assert meter.in_step_a(15) == first.in_step_a  # not a measurement: nothing kept


def test_the_engine_keeps_the_in_step_a_for_its_next_policy(monkeypatch):
    """``generate`` keeps what its writescope policy tracked; the next ``set_policy`` starts there,
    for the same CPU attention thread count only; a static policy keeps nothing."""
    from writescope import LLM, SamplingParams

    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES", raising=False)
    rf = Roofline(a=1e-3, b=1e-3)  # r near 0.5 (with the O the static run measured): the prompts have compute blocks, so CPU parts
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, cpu_threads=1)
    prompts = [[1 + i for i in range(40)], [2 + i for i in range(50)]]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert llm.other_work.in_step_a(1) is None  # static: no A tracked
    llm.set_policy("writescope", roofline=rf)
    assert llm.policy.a.value == rf.a
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    observed = llm.policy.in_step_a
    assert observed is not None and observed != rf.a
    assert llm.other_work.in_step_a(1) == observed
    llm.set_policy("writescope", roofline=rf)
    assert llm.policy.a.value == observed and llm.attention_threads == 1
    if usable_cpus() >= 2:  # another thread count starts from the roofline's A (a machine of one CPU has no other)
        llm.set_policy("writescope", cpu_threads=2, roofline=rf)
        assert llm.attention_threads == 2 and llm.policy.a.value == rf.a


def test_the_in_step_a_is_kept_for_a_later_process_per_thread_count(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES", raising=False)
    meter = ow.OtherWork(torch.device("cpu"), store_key="machine|model")
    meter.keep_in_step_a(15, 18.5e-9)
    meter.keep_in_step_a(4, 30e-9)
    path = meter.save()  # A alone (no O measured) is worth a write
    assert path == ow.store_path() and meter.save() is None
    assert json.loads(path.read_text())["machine|model"][ow.IN_STEP_A] == {"": {"15": 18.5e-9, "4": 30e-9}}
    later = ow.OtherWork(torch.device("cpu"), store_key="machine|model")
    assert later.in_step_a(15) == 18.5e-9 and later.in_step_a(4) == 30e-9 and later.in_step_a(8) is None
    assert later.seconds(16) is None  # the section is no O
    assert ow.OtherWork(torch.device("cpu"), store_key="another").in_step_a(15) is None
    p = WriteScopePolicy(DSV2)
    p.attach(later, attention_threads=15, micro_batches=1)
    assert p.a.value == 18.5e-9
    # a later save replaces only what it kept: the other thread count's entry stays
    later.keep_in_step_a(15, 20e-9)
    assert later.save() == path
    assert ow.stored("machine|model", ow.IN_STEP_A) == {("", 15): 20e-9, ("", 4): 30e-9}


def test_a_bad_stored_a_is_left_out_alone_and_o_still_loads(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = ow.store_path()
    path.parent.mkdir(parents=True)
    o = {"": {"16": 1.0e-3}, "WRITESCOPE_MOE_KERNEL=grouped": {"16": 1.5e-3}}
    bad_a = {"": {"15": "x", "1": math.inf, "2": -1e-9, "3": 0.0, "0": 1e-8, "many": 1e-8, "8": 2e-8}, "WRITESCOPE_CPU_TUNING=12": [1, 2]}
    path.write_text(json.dumps({"machine|model": {**o, ow.IN_STEP_A: bad_a}}))
    assert ow.stored("machine|model", ow.IN_STEP_A) == {("", 8): 2e-8}
    assert ow.stored("machine|model") == {("", 16): 1.0e-3, ("WRITESCOPE_MOE_KERNEL=grouped", 16): 1.5e-3}
    meter = ow.OtherWork(torch.device("cpu"), store_key="machine|model")
    assert meter.seconds(16) == 1.0e-3 and meter.in_step_a(8) == 2e-8 and meter.in_step_a(15) is None
    # a section that is no object at all, or one shaped like O's: no A, and not read as O either
    for section in ("garbage", [1.0], {"16": 1.0}):
        path.write_text(json.dumps({"machine|model": {**o, ow.IN_STEP_A: section}}))
        assert ow.stored("machine|model", ow.IN_STEP_A) == {}
        assert ow.stored("machine|model") == {("", 16): 1.0e-3, ("WRITESCOPE_MOE_KERNEL=grouped", 16): 1.5e-3}
    # a save over a bad section writes it afresh and keeps the O entries
    path.write_text(json.dumps({"machine|model": {**o, ow.IN_STEP_A: "garbage"}}))
    meter.keep_in_step_a(15, 18.5e-9)
    assert meter.save() == path
    assert ow.stored("machine|model", ow.IN_STEP_A) == {("", 15): 18.5e-9}
    assert ow.stored("machine|model")[("WRITESCOPE_MOE_KERNEL=grouped", 16)] == 1.5e-3
    # a file of the format before the section (O only) still loads
    path.write_text(json.dumps({"machine|model": o}))
    old = ow.OtherWork(torch.device("cpu"), store_key="machine|model")
    assert old.seconds(16) == 1.0e-3 and old.in_step_a(15) is None


def test_bench_prints_the_kept_in_step_a_beside_the_calibration_s(monkeypatch, tmp_path, capsys):
    import writescope.engine.llm as engine
    from writescope.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES", raising=False)
    monkeypatch.setattr(engine, "load_or_calibrate", lambda *a, **k: Roofline(a=2e-9, b=1e-3))  # r = 1: CPU parts
    assert main(["bench", "--model", "tiny-qwen3-moe", "--device", "cpu", "--batch", "2", "--context", "64", "--steps", "2",
                 "--window", "16", "--policies", "writescope", "--repeats", "1", "--quiet", "--kv-fill", "random"]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("A (CPU attention per placed token"))
    from writescope.presets import preset_config

    token = preset_config("tiny-qwen3-moe").kv_layout.bytes_per_token(4)  # fp32 on the CPU
    assert f"calibration 2 ns/token ({token / 2e-9 / 1e9:.3g} GB/s of KV read)" in line
    kept = re.search(r"in-step ([0-9.e+-]+) ns/token \(([0-9.e+-]+) GB/s of KV read\), kept from decode steps", line)
    assert kept is not None and float(kept.group(1)) > 0  # measured and kept (its value depends on this machine: not asserted)
    assert float(kept.group(2)) == pytest.approx(token / (float(kept.group(1)) * 1e-9) / 1e9, rel=0.02)  # both printed to 3 digits


# ------------------------------------------------------------------ the gate on runs 40 and 41's cells
# The balance and the split gate with O (``split_pays``) on run 40's and run 41's DeepSeek-V2-Lite
# cells: the H200's calibration and the O, O_link and ring that each run's `writescope` rows placed
# with. Measured in run 40 (benchmarks/results/gpu_decode_h200.md, runs 38-40): streaming alone won at
# 4 x 8K and over a split at r 0.45 at 4 x 16K (45.0 against 47.7 ms a step), the split won at 4 x 32K
# and at batch 16 from 8K to 32K. The gate before run 40 split 4 x 16K (r 0.45): it charged
# streaming alone a fixed cost that hides behind O and a split no hand-over. Run 41
# (benchmarks/results/grid_deepseek-v2-lite_h200_run41_b4.json) then found `static:1/3` 4-7% faster
# than streaming alone at 4 x 16K and the optimum at 4 x 32K near 1/3, where the policy, charging the
# link side's calibrated C_gpu (0.52 ms) in full, gave 0 and 0.52-0.54: the link side's fixed cost is
# now min(C_gpu, LINK_FIXED) where O is measured (writescope/scheduler/roofline.py).
RUN40 = Roofline(a=1.4879e-08, b=2.0617e-08, c_cpu=5.879e-04, c_gpu=5.505e-04, b_alone=2.0898e-08, c_gpu_alone=2.957e-04)
# run 41's calibration, saved in grid_deepseek-v2-lite_h200_run41_b4.json (and in
# gpu_decode_h200_run41_variants_dsv2_32x32k.json, the same machine's)
RUN41 = Roofline(a=1.48745e-08, b=2.04277e-08, c_cpu=4.7554e-04, c_gpu=5.2124e-04, b_alone=2.06934e-08, c_gpu_alone=2.4212e-04)
RING = 116224  # the ping-pong ring's tokens: 2 x 64 MiB of 1,152-byte MLA tokens


def _replay_share(batch: int, context: int, o: float, link: float, a: float, roofline: Roofline = RUN40) -> float:
    p = _policy(Meter(o, link), batch=batch, roofline=roofline, prefetch_tokens=RING)
    p.a = OnlineEstimate(a)
    return p.cpu_share(context)


@pytest.mark.parametrize("o", [0.42e-3, 0.60e-3, 0.82e-3])  # the O of the two repeats' placement, and above
def test_run40_batch_4_streams_alone_at_8k_and_at_16k_where_o_is_large(o):
    """Run 40 (benchmarks/results/grid_deepseek-v2-lite_h200_run40*.json, gpu_decode_h200.md): 4 x 8K
    and 4 x 16K, O_link 0.153 ms, A 14.88 ns/token."""
    assert _replay_share(4, 8192, o, 0.153e-3, 14.88e-9) == 0.0  # the balance itself gives 0 at 8K
    r16 = _replay_share(4, 16384, o, 0.153e-3, 14.88e-9)
    if o >= 0.6e-3:
        # the balance gives 0.20 (O 0.60) and 0.11 (O 0.82): with the CPU part behind that O and the
        # 0.15 ms hand-over, the split is predicted no faster than streaming alone (1.53 against 1.52
        # ms a layer at O 0.60), so the gate refuses it
        assert r16 == 0.0
    else:
        # at O 0.42 ms the split is predicted to pay (1.43 against 1.52 ms a layer) at eq. 2's share
        # with the link side's fixed cost at LINK_FIXED, about 0.28: below the 0.45 run 40 measured
        # slower than streaming alone, near the 1/3 that run 41 measured 4-7% faster at 4 x 16K
        assert r16 == pytest.approx(roofline_share(4 * 16384, 14.88e-9, RUN40.b, RUN40.c_cpu + o, LINK_FIXED + 0.153e-3),
                                    rel=1e-12)
        assert 0.2 <= r16 <= 0.36


@pytest.mark.parametrize("o", [0.42e-3, 0.60e-3])
def test_run40_batch_4_splits_at_32k(o):
    """Run 40: 4 x 32K, where the split won. Eq. 2 with the link side's fixed cost at LINK_FIXED gives
    0.43 (O 0.42) and 0.39 (O 0.60): the static rows' optimum there was 0.39-0.40 (gpu_decode_h200.md)."""
    assert _replay_share(4, 32768, o, 0.153e-3, 14.88e-9) > 0.38


@pytest.mark.parametrize("context, floor", [(8192, 0.30), (16384, 0.40), (32768, 0.45)])
def test_run40_batch_16_splits(context, floor):
    """Run 40 (benchmarks/results/grid_deepseek-v2-lite_h200_run40_b16.json): batch 16, O 1.07 ms,
    O_link 0.418 ms, A 17.1 ns/token; eq. 2 gives about 0.326 / 0.436 / 0.492 at 8K / 16K / 32K. The
    floors are the measured crossings: at 8K `static:1/3` (71.4 / 74.2 ms a step) beat `static:2/3`
    (79.3 / 81.9) with its CPU part already the longer side; at 16K and 32K the parts of the 1/3 and
    2/3 rows cross at about 0.42 and 0.47. Guards that the smaller link-side fixed cost, which lowers
    r, does not pull batch 16 below them."""
    assert _replay_share(16, context, 1.07e-3, 0.418e-3, 17.1e-9) > floor


# run 41's 4 x 8K / 16K / 32K cells (grid_deepseek-v2-lite_h200_run41_b4.json): the O each `writescope`
# row placed with (the meter's O after the `monolithic` row before it), O_link 0.152 ms (the host
# experts' bytes read in place at B), A as calibrated (no decode step had taught one), batch 4
RUN41_LINK, RUN41_A = 0.152e-3, 14.87e-9


@pytest.mark.parametrize("o", [0.703e-3, 0.778e-3])
def test_run41_batch_4_streams_alone_at_8k(o):
    """Run 41, 4 x 8K (grid_deepseek-v2-lite_h200_run41_b4.json): streaming alone won (`gpu` 26.7 /
    27.4 ms a step, `static:0` 29.0 / 30.4, `static:1/3` 31.2 / 39.7)."""
    assert _replay_share(4, 8192, o, RUN41_LINK, RUN41_A, RUN41) == 0.0


@pytest.mark.parametrize("o", [0.416e-3, 0.593e-3])
def test_run41_batch_4_splits_near_a_third_at_16k(o):
    """Run 41, 4 x 16K (grid_deepseek-v2-lite_h200_run41_b4.json): `static:1/3` took 42.9 / 41.8 ms a
    step, streaming alone 44.8 (`gpu`, `static:0`), `static:2/3` 47.3 / 46.0; `writescope` with the
    calibrated C_gpu on the link side streamed alone (45.0). Eq. 2 with LINK_FIXED gives 0.25 (O
    0.593) and 0.32 (O 0.416), and the gate passes them."""
    r = _replay_share(4, 16384, o, RUN41_LINK, RUN41_A, RUN41)
    assert 0.2 <= r <= 0.36


@pytest.mark.parametrize("o", [0.369e-3, 0.442e-3])
def test_run41_batch_4_splits_below_the_old_share_at_32k(o):
    """Run 41, 4 x 32K (grid_deepseek-v2-lite_h200_run41_b4.json): `writescope` deployed 0.539 / 0.523
    (61.0 / 59.6 ms a step) with the calibrated C_gpu on the link side, `static:1/3` took 58.7 / 58.4,
    `static:2/3` 66.0 / 66.2. Eq. 2 with LINK_FIXED gives 0.46 / 0.45: toward the optimum near 1/3,
    and still a split."""
    r = _replay_share(4, 32768, o, RUN41_LINK, RUN41_A, RUN41)
    assert 0.3 < r < 0.47


def test_run41_batch_32_at_32k_still_splits_above_half():
    """Run 41, 32 x 32K (gpu_decode_h200_run41_variants_dsv2_32x32k.json): O 1.27 ms, O_link 0.587 ms,
    the A of the middle repeat 15.8 ns/token; `writescope` deployed 0.562 / 0.547 / 0.523 and ran 321 /
    333 / 356 ms a step, the higher shares the faster. Eq. 2 with LINK_FIXED gives about 0.537 (0.547
    with C_gpu in full): a guard that the cap moves r little here."""
    assert _replay_share(32, 32768, 1.27e-3, 0.587e-3, 15.8e-9, RUN41) > 0.5
