"""The in-step C_cpu (writescope/scheduler/roofline.py ``WriteScopePolicy.observe``), kept for the
next policy (writescope/scheduler/other_work.py), and the ``WRITESCOPE_LINK_FIXED`` A/B switch."""

from __future__ import annotations

import json
import math

import pytest
import torch

from writescope.kvcache.spec import Roofline
from writescope.scheduler import other_work as ow
from writescope.scheduler import roofline as rl
from writescope.scheduler.roofline import LINK_FIXED, MAX_FIXED_SHARE, WriteScopePolicy, link_fixed_from_env, roofline_share

# run 62 (an H100 host), DeepSeek-V2-Lite batch 16: the calibration, and O and its in-place expert reads a layer step
RUN62 = Roofline(a=2.0874e-08, b=2.0986e-08, c_cpu=1.2605e-3, c_gpu=3.576e-4, b_alone=2.0784e-08, c_gpu_alone=3.2155e-4)
O, O_LINK = 1.1e-3, 0.55e-3
PLACED = 8192 - 256  # 16 x 8K, tokens per sequence outside the D-window


class Meter:
    """Fixed O and O_link; the in-step A and C_cpu as given (None: none kept)."""

    def __init__(self, a=None, c=None):
        self.a, self.c = a, c

    def seconds(self, batch):
        return O

    def link(self, batch):
        return O_LINK

    def in_step_a(self, threads):
        return self.a

    def in_step_c(self, threads):
        return self.c


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
    its parts of about 20K tokens took 0.98 ms; `static:0.333333` ran 9% faster. Those parts are too
    small to teach A (C_cpu is most of them), so they teach C_cpu: about 0.55 ms, and the balance
    then places about a third."""
    p = _policy(Meter())
    before = p.cpu_share(PLACED)
    assert 0.1 < before < 0.22
    tokens = 20480
    assert RUN62.c_cpu > MAX_FIXED_SHARE * (RUN62.c_cpu + RUN62.a * tokens)  # the regime of C_cpu, not A
    for _ in range(12):
        p.observe(0.98e-3, tokens, batch=16)
    assert p.in_step_a is None and p.a.value == RUN62.a  # A untouched
    assert p.in_step_c == pytest.approx(0.98e-3 - RUN62.a * tokens, rel=0.02)
    after = p.cpu_share(PLACED)
    assert 0.28 < after < 0.40
    assert p.roofline is RUN62  # the calibration itself is left as it was
    # the gate passes it: streaming alone pays O_link on the link too
    assert after == pytest.approx(roofline_share(16 * PLACED, RUN62.a, RUN62.b, p.c.value + O,
                                                 min(RUN62.c_gpu, LINK_FIXED) + O_LINK), rel=1e-12)


def test_large_parts_teach_a_over_the_tracked_c_cpu():
    p = _policy(Meter(c=0.6e-3))
    assert p.c.value == 0.6e-3 and p.in_step_c is None  # started from the kept one, not yet observed
    tokens = 262144  # 16 x 32K at r 0.5: A dominates
    for _ in range(12):
        p.observe(0.6e-3 + 15e-9 * tokens, tokens, batch=16)
    assert p.in_step_a == pytest.approx(15e-9, rel=0.01) and p.in_step_c is None


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 4097])
def test_a_c_cpu_sample_is_floored_at_zero_and_bad_times_are_no_sample(tokens):
    p = _policy(Meter())
    p.observe(RUN62.a * tokens / 2, tokens, batch=16)  # cheaper than its tokens at the tracked A
    assert list(p.c.samples) == [0.0] and p.in_step_c < RUN62.c_cpu
    q = _policy(Meter())
    for bad in (math.nan, -math.inf, math.inf):
        q.observe(bad, tokens, batch=16)
    q.observe(1e-3, 0, batch=16)  # no tokens: no part
    assert q.in_step_c is None and q.in_step_a is None


def test_the_meter_keeps_c_cpu_per_thread_count_and_for_a_later_process(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    meter = ow.OtherWork(torch.device("cpu"), store_key="machine|model")
    for bad in (None, math.nan, math.inf, -1e-6):
        meter.keep_in_step_c(15, bad)
    assert meter.in_step_c(15) is None and meter.save() is None
    meter.keep_in_step_c(15, 0.55e-3)
    meter.keep_in_step_c(4, 0.0)  # no fixed cost is a measurement
    meter.keep_in_step_a(15, 18.5e-9)
    path = meter.save()
    doc = json.loads(path.read_text())["machine|model"]
    assert doc[ow.IN_STEP_C] == {"": {"15": 0.55e-3, "4": 0.0}} and doc[ow.IN_STEP_A] == {"": {"15": 18.5e-9}}
    later = ow.OtherWork(torch.device("cpu"), store_key="machine|model")
    assert later.in_step_c(15) == 0.55e-3 and later.in_step_c(4) == 0.0 and later.in_step_c(8) is None
    assert later.seconds(16) is None  # neither section is read as O
    p = WriteScopePolicy(RUN62)
    p.attach(later, attention_threads=15, micro_batches=1)
    assert p.c.value == 0.55e-3 and p.a.value == 18.5e-9
    # a bad stored entry is left out alone
    path.write_text(json.dumps({"machine|model": {ow.IN_STEP_C: {"": {"15": -1.0, "4": "x", "8": 0.4e-3}}}}))
    assert ow.stored("machine|model", ow.IN_STEP_C) == {("", 8): 0.4e-3}


def test_the_engine_keeps_the_in_step_c_for_its_next_policy(monkeypatch):
    """A roofline whose C_cpu dwarfs the tiny model's parts: every part teaches C_cpu, ``generate``
    keeps it, and the next ``set_policy`` starts from it."""
    from writescope import LLM, SamplingParams

    rf = Roofline(a=1e-9, b=1.0, c_cpu=1.0)  # r near 1 whatever C_cpu: CPU parts in every step
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, cpu_threads=1)
    llm.set_policy("writescope", roofline=rf)
    prompts = [[1 + i for i in range(40)], [2 + i for i in range(50)]]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    learnt = llm.policy.in_step_c
    assert learnt is not None and 0 <= learnt < 1.0  # a tiny part takes far less than a second
    assert llm.other_work.in_step_c(1) == learnt
    llm.set_policy("writescope", roofline=rf)
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
