"""The in-step C_cpu (writescope/scheduler/roofline.py ``WriteScopePolicy.observe``), kept per batch size
for the next policy (writescope/scheduler/other_work.py), and the ``WRITESCOPE_LINK_FIXED`` A/B switch."""

from __future__ import annotations

import math
import types

import pytest
import torch

from writescope.kvcache.spec import Roofline
from writescope.scheduler import other_work as ow
from writescope.scheduler import roofline as rl
from writescope.scheduler.roofline import (C_BAND, C_RANGE, LINK_FIXED, MAX_FIXED_SHARE, WriteScopePolicy, link_fixed_from_env,
                                          roofline_share)

# run 62 (an H100 host), DeepSeek-V2-Lite batch 16: the calibration, and O and its in-place expert reads a layer step
RUN62 = Roofline(a=2.0874e-08, b=2.0986e-08, c_cpu=1.2605e-3, c_gpu=3.576e-4, b_alone=2.0784e-08, c_gpu_alone=3.2155e-4)
O, O_LINK = 1.1e-3, 0.55e-3
PLACED = 8192 - 256  # 16 x 8K, tokens per sequence outside the D-window


class Meter:
    """Fixed O and O_link; the in-step A and C_cpu as given (None: none kept)."""

    def __init__(self, a=None, c=None):
        self.a, self.c = a, c

    def seconds(self, batch, path=None):
        return O

    def link(self, batch):
        return O_LINK

    def in_step_a(self, threads):
        return self.a

    def in_step_c(self, threads, batch):
        return self.c.get(batch) if self.c else None


def _policy(meter, roofline=RUN62, batch=16):
    p = WriteScopePolicy(roofline)
    p.attach(meter, attention_threads=15, micro_batches=1)
    p.expect_batch(batch)
    return p


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch):
    for name in ("WRITESCOPE_MICRO_BATCHES", "WRITESCOPE_LINK_FIXED"):
        monkeypatch.delenv(name, raising=False)


def test_small_parts_teach_c_cpu_and_move_r_to_where_run_62_ran_fastest():
    """Run 62, DSV2 16 x 8K: `writescope` placed r 0.16-0.19 with the calibrated C_cpu (1.26 ms) and
    its parts of about 20K tokens took 0.98 ms; `static:0.333333` ran 9% faster. Those parts teach
    C_cpu (their calibrated per-token time is under their fixed cost): about 0.55 ms, and the
    balance then places about a third."""
    p = _policy(Meter())
    before = p.cpu_share(PLACED)
    assert 0.1 < before < 0.22
    tokens = 20480
    assert RUN62.a * tokens <= C_BAND * (RUN62.c_cpu + RUN62.a * tokens)  # the regime of C_cpu, not A
    for _ in range(12):
        p.observe(0.98e-3, tokens, batch=16)
    assert p.in_step_a is None and p.a.value == RUN62.a  # A untouched
    assert p.in_step_c == pytest.approx(0.98e-3 - RUN62.a * tokens, rel=0.02)
    after = p.cpu_share(PLACED)
    assert 0.28 < after < 0.40
    assert p.roofline is RUN62  # the calibration itself is left as it was
    assert after == pytest.approx(roofline_share(16 * PLACED, RUN62.a, RUN62.b, p.c.value + O,
                                                 min(RUN62.c_gpu, LINK_FIXED) + O_LINK), rel=1e-12)


def _run62_part(tokens: int) -> float:
    """A CPU part's time as run 62's DSV2 batch-16 decode steps took it: about 0.6 ms + 15 ns a token."""
    return 0.6e-3 + 15e-9 * tokens


def test_a_grid_of_rows_places_8k_alike_before_and_after_the_larger_contexts():
    """The reviewer's case: rows 8K, 16K, 32K and 8K again, each placed with what the rows before it
    kept, its parts timed as run 62's were (C_cpu 0.6 ms, A 15 ns against a calibrated 20.9). The
    C_cpu learnt stays in its band, and the second 8K row places what the first placed once it had
    learnt (about a third), not the runaway a C_cpu absorbing A's error would give."""
    kept_a, kept_c = None, {}
    placed = []
    for context in (8192, 16384, 32768, 8192):
        p = _policy(Meter(a=kept_a, c=dict(kept_c)))
        r = p.cpu_share(context - 256)
        placed.append(r)
        tokens = round(r * 16 * (context - 256))
        for _ in range(40):  # one decode step's layers and more
            p.observe(_run62_part(tokens), tokens, batch=16)
        kept_a = p.in_step_a or kept_a
        if p.in_step_c is not None:
            kept_c[16] = p.in_step_c
        lo, hi = C_RANGE
        assert lo * RUN62.c_cpu <= p.c.value <= hi * RUN62.c_cpu
    first_8k, again_8k = placed[0], placed[3]
    assert 0.1 < first_8k < 0.22  # calibrated C_cpu: nothing learnt yet
    assert 0.28 < again_8k < 0.42
    assert 0.3 < placed[1] < 0.55 and 0.35 < placed[2] < 0.6  # 16K and 32K near run 62's best (0.34-0.51)


def test_large_parts_teach_a_over_the_tracked_c_cpu_and_middle_parts_neither():
    p = _policy(Meter(c={16: 0.6e-3}))
    assert p.c.value == 0.6e-3 and p.in_step_c is None  # started from the kept one, not yet observed
    tokens = 262144  # 16 x 32K at r 0.5: A dominates
    for _ in range(12):
        p.observe(0.6e-3 + 15e-9 * tokens, tokens, batch=16)
    assert p.in_step_a == pytest.approx(15e-9, rel=0.01) and p.in_step_c is None
    q = _policy(Meter())
    middle = 100_000  # A_cal x tokens 2.09 ms against C_cal 1.26: between the bands
    assert RUN62.c_cpu > MAX_FIXED_SHARE * (RUN62.c_cpu + RUN62.a * middle)
    assert RUN62.a * middle > C_BAND * (RUN62.c_cpu + RUN62.a * middle)
    q.observe(_run62_part(middle), middle, batch=16)
    assert q.in_step_a is None and q.in_step_c is None


def test_c_cpu_is_tracked_per_batch_size():
    p = _policy(Meter(c={16: 0.5e-3}))
    assert p.c.value == 0.5e-3
    p.expect_batch(4)  # no kept value at batch 4: the calibration's
    assert p.c.value == RUN62.c_cpu
    p.observe(0.9e-3, 1000, batch=4)
    assert p.in_step_c is not None and p.in_step_c < RUN62.c_cpu
    p.observe(0.9e-3, 1000, batch=16)  # back at 16: the kept one again, then its own sample
    assert len(p.c.samples) == 1 and p.c.value == pytest.approx(0.5e-3 + 0.3 * (0.9e-3 - RUN62.a * 1000 - 0.5e-3))


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 4097])
def test_a_c_cpu_sample_stays_in_its_range_and_bad_times_are_no_sample(tokens):
    lo, hi = C_RANGE
    p = _policy(Meter())
    p.observe(RUN62.a * tokens / 2, tokens, batch=16)  # cheaper than its tokens at the tracked A
    assert list(p.c.samples) == [lo * RUN62.c_cpu]
    p.observe(1.0, tokens, batch=16)  # a part of a second (a page fault, a preempted thread)
    assert list(p.c.samples)[-1] == hi * RUN62.c_cpu
    q = _policy(Meter())
    for bad in (math.nan, -math.inf, math.inf):
        q.observe(bad, tokens, batch=16)
    q.observe(1e-3, 0, batch=16)  # no tokens: no part
    assert q.in_step_c is None and q.in_step_a is None


def test_the_meter_keeps_c_cpu_per_thread_count_and_batch_in_this_process(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    meter = ow.OtherWork(torch.device("cpu"), store_key="machine|model")
    for bad in (None, math.nan, math.inf, -1e-6):
        meter.keep_in_step_c(15, 16, bad)
    assert meter.in_step_c(15, 16) is None
    meter.keep_in_step_c(15, 16, 0.55e-3)
    meter.keep_in_step_c(15, 4, 0.0)  # no fixed cost is a measurement
    assert meter.in_step_c(15, 16) == 0.55e-3 and meter.in_step_c(15, 4) == 0.0
    assert meter.in_step_c(8, 16) is None and meter.in_step_c(15, 32) is None
    assert meter.save() is None  # not written: nothing else was measured
    p = WriteScopePolicy(RUN62)
    p.attach(meter, attention_threads=15, micro_batches=1)
    p.expect_batch(16)
    assert p.c.value == 0.55e-3
    with meter.paused():
        meter.keep_in_step_c(15, 16, 1e-3)
    assert meter.in_step_c(15, 16) == 0.55e-3
    meter.forget_in_step_c()
    assert meter.in_step_c(15, 16) is None
    assert ow.OtherWork(torch.device("cpu"), store_key="machine|model").in_step_c(15, 16) is None  # not on disk


def test_the_joint_costs_take_the_tracked_c_cpu():
    from writescope.scheduler.expert_work import ExpertWork

    p = _policy(Meter(c={16: 0.5e-3}))
    costs = ExpertWork.costs(types.SimpleNamespace(policy=p, e=types.SimpleNamespace(value=1e-11),
                                                   g_link=types.SimpleNamespace(value=2e-11)))
    assert costs.c_cpu == 0.5e-3 and costs.a == RUN62.a


def test_the_engine_keeps_the_in_step_c_for_its_next_policy():
    """A roofline whose calibrated C_cpu dwarfs the tiny model's parts: its parts teach C_cpu,
    ``generate`` keeps it for that batch size, and the next ``set_policy`` starts from it there."""
    from writescope import LLM, SamplingParams

    rf = Roofline(a=1e-12, b=1.0, c_cpu=0.01)  # r near 1 whatever C_cpu: CPU parts in every step; each under 20 ms
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, cpu_threads=1)
    llm.set_policy("writescope", roofline=rf)
    prompts = [[1 + i for i in range(40)], [2 + i for i in range(50)]]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    learnt = llm.policy.in_step_c
    lo, hi = C_RANGE
    assert learnt is not None and lo * rf.c_cpu <= learnt <= hi * rf.c_cpu
    assert len(llm.policy.c.samples) > 0 and llm.other_work.in_step_c(1, 2) == learnt
    llm.set_policy("writescope", roofline=rf)
    llm.policy.expect_batch(2)
    assert llm.policy.c.value == learnt and llm.policy.in_step_c is None


# ------------------------------------------------------------------ WRITESCOPE_LINK_FIXED
def test_link_fixed_sets_the_link_side_in_the_balance_and_in_the_gate_s_alone(monkeypatch):
    seen = []
    real = rl.split_pays
    monkeypatch.setattr(rl, "split_pays", lambda *a, **k: (seen.append(a), real(*a, **k))[1])
    default = _policy(Meter()).cpu_share(PLACED)
    assert seen[-1][3].c_gpu == min(RUN62.c_gpu, LINK_FIXED) and seen[-1][7] == 0.0
    monkeypatch.setenv("WRITESCOPE_LINK_FIXED", "0.6")
    raised = _policy(Meter()).cpu_share(PLACED)
    assert seen[-1][3].c_gpu == pytest.approx(0.6e-3) and seen[-1][7] == pytest.approx(0.6e-3)
    assert raised > default  # a dearer link side: more on the CPU
    assert raised == pytest.approx(roofline_share(16 * PLACED, RUN62.a, RUN62.b, RUN62.c_cpu + O, 0.6e-3 + O_LINK), rel=1e-12)
    # streaming alone pays it too: a split that paid by less than it no longer does
    L = 16 * PLACED
    assert not rl.split_pays(L, 0.9, RUN62.a, RUN62, O, O_LINK, None, 0.0)  # most on the CPU: slower than streaming alone
    assert rl.split_pays(L, 0.9, RUN62.a, RUN62, O, O_LINK, None, 5e-3)  # unless streaming alone pays 5 ms more a layer


@pytest.mark.parametrize("raw", ["x", "-0.1", "nan", "inf", "1e400"])
def test_a_bad_link_fixed_is_named(monkeypatch, raw):
    monkeypatch.setenv("WRITESCOPE_LINK_FIXED", raw)
    with pytest.raises(ValueError, match=r"WRITESCOPE_LINK_FIXED=.*milliseconds"):
        link_fixed_from_env()


def test_link_fixed_does_not_part_the_kept_o(monkeypatch):
    """It steers only the model: O and the kept A and C_cpu are the same with it set."""
    monkeypatch.setenv("WRITESCOPE_LINK_FIXED", "0.4")
    assert ow.switch_signature() == ""
    monkeypatch.setenv("WRITESCOPE_CPU_TUNING", "12")
    assert ow.switch_signature() == "WRITESCOPE_CPU_TUNING=12"


def test_the_prompt_plan_does_not_part_the_kept_o(monkeypatch):
    """The order of a prompt's blocks changes nothing a decode step does: a compute-last row places
    from the same kept O and A as the default."""
    monkeypatch.setenv("WRITESCOPE_PROMPT_PLAN", "compute-last")
    assert ow.switch_signature() == ""


def test_link_fixed_has_no_effect_without_o_or_in_micro_batched_steps(monkeypatch):
    class NoO(Meter):
        def seconds(self, batch, path=None):
            return None

    for meter, micro in ((NoO(), 1), (Meter(), 2)):
        p = WriteScopePolicy(RUN62)
        p.attach(meter, attention_threads=15, micro_batches=micro)
        p.expect_batch(16)
        default = p.cpu_share(PLACED)
        monkeypatch.setenv("WRITESCOPE_LINK_FIXED", "3")
        assert p.cpu_share(PLACED) == default
        monkeypatch.delenv("WRITESCOPE_LINK_FIXED")
