"""The roofline share r(L), the online estimate of A, the ``writescope`` policy and calibration."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from writescope import LLM, SamplingParams
from writescope.attention.metadata import ForwardBatch
from writescope.config import KVLayout
from writescope.kvcache.inplace import InplaceKVCache
from writescope.kvcache.spec import PartitionSpec, Roofline
from writescope.scheduler.calibrate import calibrate, load, load_or_calibrate, save, shape_key
from writescope.scheduler.policies import COMPUTE, LOAD, parse_policy
from writescope.scheduler.roofline import A_FLOOR, OnlineEstimate, WriteScopePolicy, roofline_share, split_pays


# ------------------------------------------------------------------ r(L)
def test_share_tends_to_b_over_a_plus_b():
    for a, b, c_cpu, c_gpu in [(1.0, 3.0, 0.0, 0.0), (2e-9, 5e-9, 1e-3, 4e-3), (5e-9, 1e-9, 2e-3, 0.0)]:
        assert roofline_share(1e15, a, b, c_cpu, c_gpu) == pytest.approx(b / (a + b), abs=1e-6)


def test_share_balances_both_sides():
    a, b, c_cpu, c_gpu, L = 2e-9, 3e-9, 1e-4, 6e-4, 1e6
    r = roofline_share(L, a, b, c_cpu, c_gpu)
    assert 0 < r < 1
    assert r * a * L + c_cpu == pytest.approx((1 - r) * b * L + c_gpu, rel=1e-9)  # paper eq. 2


def test_share_clamps_and_follows_the_sign_of_delta():
    a, b = 1e-9, 1e-9
    assert roofline_share(10, a, b, c_cpu=0.0, c_gpu=1.0) == 1.0  # GPU fixed cost dominates: all CPU
    assert roofline_share(10, a, b, c_cpu=1.0, c_gpu=0.0) == 0.0
    base = roofline_share(1e6, a, b)
    assert roofline_share(1e6, a, b, 0.0, 1e-4) > base > roofline_share(1e6, a, b, 1e-4, 0.0)


@pytest.mark.parametrize(
    "L, a, b, c_cpu, c_gpu, want",
    [
        (0, 1.0, 1.0, 0.0, 0.0, 0.5),  # L = 0, delta = 0: the limit share
        (0, 1.0, 1.0, 0.0, 1.0, 1.0),
        (0, 1.0, 1.0, 1.0, 0.0, 0.0),
        (100, 0.0, 1.0, 0.0, 0.0, 1.0),  # free CPU: all there
        (100, 1.0, 0.0, 0.0, 0.0, 0.0),  # free loads: all streamed
        (100, 0.0, 0.0, 0.0, 0.0, 0.5),  # nothing costs anything
        (100, 0.0, 0.0, 1.0, 0.0, 0.0),
    ],
)
def test_degenerate_inputs_do_not_divide_by_zero(L, a, b, c_cpu, c_gpu, want):
    assert roofline_share(L, a, b, c_cpu, c_gpu) == want


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="A must be >= 0"):
        roofline_share(10, -1.0, 1.0)
    with pytest.raises(ValueError, match="L must be >= 0"):
        roofline_share(float("nan"), 1.0, 1.0)


# ------------------------------------------------------------------ tracker
def test_tracker_converges_within_ten_samples_after_a_step():
    est = OnlineEstimate(1.0)  # alpha 0.3, median of 3
    for _ in range(10):
        est.update(1.0)
    for _ in range(10):  # the documented bound: 1 + ceil(log 0.05 / log 0.7) = 10
        est.update(4.0)
    assert abs(est.value - 4.0) <= 0.05 * 3.0


def test_one_outlier_does_not_move_the_estimate():
    est = OnlineEstimate(2.0)
    for _ in range(5):
        est.update(2.0)
    est.update(200.0)
    assert est.value == pytest.approx(2.0, abs=1e-12)
    est.update(float("nan"))
    est.update(-1.0)
    assert est.value == pytest.approx(2.0, abs=1e-12)


def test_policy_tracks_a_with_a_floor():
    pol = WriteScopePolicy(Roofline(a=1e-9, b=1e-9, c_cpu=1e-4, c_gpu=0.0))
    for _ in range(20):
        pol.observe(1e-4 + 3e-9 * 1_000_000, 1_000_000, batch=4)  # A tripled (contention)
    assert pol.a.value == pytest.approx(3e-9, rel=0.02)
    assert pol.cpu_share(10**6) < roofline_share(4e6, 1e-9, 1e-9, 1e-4, 0.0)  # less goes to the CPU
    for _ in range(20):
        pol.observe(4e-4, 10**7, batch=4)  # far below A per token: floored
    assert pol.a.value == pytest.approx(A_FLOOR * 1e-9, rel=0.05)


def test_parts_mostly_fixed_cost_teach_no_a():
    """Run 37: the bench's warm-up at 512 tokens (CPU parts of 4,096 tokens, about 0.48 ms against
    C_cpu 0.30 ms) taught A = 43 ns/token where the calibration said 23.6, and the first 32K row
    placed r = 0.41 instead of 0.53. Parts whose C_cpu is more than a quarter of their time give
    no sample; a 32K part (5.5 ms) does."""
    from writescope.scheduler.roofline import MAX_FIXED_SHARE

    rf = Roofline(a=2.3636e-08, b=3.72096e-08, c_cpu=3.0006e-4, c_gpu=2.8814e-4)
    pol = WriteScopePolicy(rf)
    for _ in range(10):
        pol.observe(0.476e-3, 4096, batch=16)
    assert pol.in_step_a is None and pol.a.value == rf.a  # nothing learnt: the engine keeps nothing
    at_share = math.ceil((1 / MAX_FIXED_SHARE - 1) * rf.c_cpu / rf.a)  # C_cpu a quarter of C_cpu + A tokens
    for tokens in (1, 15, 16, 17, 4097, at_share - 1):
        pol.observe(1.0, tokens, batch=16)  # however long it took: the calibrated time decides
    assert pol.in_step_a is None
    pol.observe(rf.c_cpu + rf.a * at_share, at_share, batch=16)  # at the share: a sample
    assert pol.in_step_a is not None
    pol = WriteScopePolicy(rf)
    for _ in range(10):
        pol.observe(rf.c_cpu + 26e-9 * 213_000, 213_000, batch=16)
    assert pol.in_step_a == pytest.approx(26e-9, rel=0.02)


@pytest.mark.parametrize("times_c", [4.0, 4.5, 6.0, 20.0])
def test_noisy_parts_near_the_gate_teach_an_unbiased_a(times_c):
    """Parts of one size whose calibrated time is ``times_c`` x C_cpu, timed with +-10% noise: every
    one gives a sample (the gate reads the calibrated time, not the measured one, so it does not
    keep only the slow ones), and A lands within 5% of the truth."""
    rf = Roofline(a=2.3636e-08, b=3.72096e-08, c_cpu=3.0006e-4, c_gpu=2.8814e-4)
    tokens = math.ceil((times_c - 1) * rf.c_cpu / rf.a)
    g = torch.Generator().manual_seed(int(times_c * 10))
    pol = WriteScopePolicy(rf)
    for _ in range(60):
        pol.observe((rf.c_cpu + rf.a * tokens) * (1 + 0.1 * (2 * torch.rand((), generator=g).item() - 1)), tokens, batch=16)
    assert len(pol.a.samples) > 0 and pol.a.value == pytest.approx(rf.a, rel=0.05)


def test_a_split_must_beat_streaming_alone():
    # 16 x 16K tokens, DSV2 as calibrated on the H200 (A 68 ns, B 21.6 ns, C_cpu 5.6 ms, C_gpu 3.05 ms):
    # the paper's r(L) is 0.131 and predicts 8.0 ms against 8.7 ms for r = 0
    L, paper = 16 * 16384, dict(a=68e-9, b=21.6e-9, c_cpu=5.6e-3, c_gpu=3.05e-3)
    r = roofline_share(L, **paper)
    assert r == pytest.approx(0.131, abs=0.002)
    assert WriteScopePolicy(Roofline(**paper)).cpu_share(L) == r  # no stand-alone calibration: the paper's share
    # streaming alone: 7.56 ms measured, split here into an assumed 21.2 ns/token + 2.0 ms; a split adds an
    # assumed 1.8 ms (about the batch-16 overruns): keep r = 0
    alone = Roofline(**paper, b_alone=21.2e-9, c_gpu_alone=2.0e-3, c_split=1.8e-3)
    assert not split_pays(L, r, alone.a, alone)
    assert WriteScopePolicy(alone).cpu_share(L) == 0.0
    # a split that adds nothing and streaming alone no faster than the contended side: the share stands
    free = Roofline(**paper, b_alone=paper["b"], c_gpu_alone=paper["c_gpu"], c_split=0.0)
    assert split_pays(L, r, free.a, free) and WriteScopePolicy(free).cpu_share(L) == r
    assert split_pays(L, 0.0, free.a, alone)  # r = 0 is no split
    # only C_split decides: without it the split is 1 ms faster than streaming alone
    near = Roofline(**paper, b_alone=paper["b"], c_gpu_alone=paper["c_gpu"] + 1e-3, c_split=0.0)
    assert WriteScopePolicy(near).cpu_share(L) == r
    assert WriteScopePolicy(Roofline(**{**vars(near), "c_split": 2e-3})).cpu_share(L) == 0.0
    # r = 1: the GPU still attends the D-window, so a step costs at least C_gpu
    cheap_cpu = Roofline(a=1e-12, b=1e-6, c_gpu=1e-3, b_alone=1e-6, c_gpu_alone=0.0, c_split=0.0)
    assert roofline_share(1000, 1e-12, 1e-6, 0.0, 1e-3) == 1.0
    assert not split_pays(1000, 1.0, 1e-12, cheap_cpu)  # 1 ms (C_gpu) against 1 ms alone: not faster
    assert WriteScopePolicy(cheap_cpu).cpu_share(1000) == 0.0
    cheaper = Roofline(**{**vars(cheap_cpu), "c_gpu_alone": 1e-3})  # alone 2 ms: the CPU share pays
    assert split_pays(1000, 1.0, 1e-12, cheaper) and WriteScopePolicy(cheaper).cpu_share(1000) == 1.0


# ------------------------------------------------------------------ routing with feedback
def _decode(cache, slots, steps, layout, q_heads, g):
    for _ in range(steps):
        B = len(slots)
        q = torch.randn(B, q_heads, layout.k_dim, generator=g)
        k = torch.randn(B, layout.kv_heads, layout.k_dim, generator=g)
        v = torch.randn(B, layout.kv_heads, layout.v_dim, generator=g)
        cache.attend(0, q, k, v, ForwardBatch.build(slots, [1] * B, [cache.seq_len(s) for s in slots], "cpu"), 0.1)


def test_routing_follows_the_target_and_never_moves_placed_blocks():
    layout, D = KVLayout(2, 8, 8, False), 8
    pol = WriteScopePolicy(Roofline(a=1.0, b=1.0))  # r = 0.5
    pol.a.alpha = 0.0  # hold A fixed (no feedback from this machine's timings) to test routing alone
    cache = InplaceKVCache(PartitionSpec(layout, 1, torch.float32, window=D), pol, "cpu")
    g = torch.Generator().manual_seed(0)
    slot = cache.allocate(64 + 40 * D, prompt_len=64)
    cache.write(slot, 0, torch.randn(64, 2, 8, generator=g), torch.randn(64, 2, 8, generator=g))
    _decode(cache, [slot], 16 * D, layout, 4, g)
    seq = cache.sequence(slot)
    n = len(seq.homes)
    assert abs(sum(r == COMPUTE for r, _ in seq.homes) - 0.5 * n) <= 1  # within one eviction batch
    before = list(seq.homes)
    pol.a.value = 9.0  # CPU now 9x slower: target share drops to 0.1
    _decode(cache, [slot], 16 * D, layout, 4, g)
    assert seq.homes[:n] == before  # nothing placed moved
    assert all(r == LOAD for r, _ in seq.homes[n:])  # new batches go to the load region
    seq.check_invariants()
    cache.close()


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_writescope_policy_gives_resident_tokens(preset):
    llm = LLM(preset, progress=False)
    prompts = [list(range(3, 3 + n)) for n in (70, 33, 5)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm.set_policy("writescope", window=16, roofline=Roofline(a=1e-9, b=2e-9, c_cpu=0.0, c_gpu=0.0))  # r = 2/3
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.kv_placement["compute"] for o in outs) > 0 and sum(o.kv_placement["load"] for o in outs) > 0


def test_prefill_plan_uses_the_announced_batch_and_is_kept():
    # delta = C_gpu - C_cpu > 0 shifts work to the CPU by delta / ((A + B) L batch): with batch 1
    # a 256-token prompt would go all to the CPU, with batch 16 near B / (A + B) = 0.25
    rf = Roofline(a=3e-6, b=1e-6, c_cpu=0.0, c_gpu=2e-3)
    P, D = 256, 16
    want = {b: math.floor(roofline_share(P * b, rf.a, rf.b, rf.c_cpu, rf.c_gpu) * P / D + 0.5) for b in (1, 16)}
    assert want[1] == P // D and want[16] < P // D
    for batch in (1, 16):
        cache = InplaceKVCache(PartitionSpec(KVLayout(2, 8, 8, False), 1, torch.float32, window=D), WriteScopePolicy(rf), torch.device("cpu"))
        cache.expect_batch(batch)
        slot = cache.allocate(P + 8, prompt_len=P)
        sq = cache.sequence(slot)
        assert sq.prompt_plan().count(COMPUTE) == want[batch]
        cache.policy.a.value *= 100  # a later estimate does not change the prompt's plan
        cache.write(slot, 0, torch.randn(P, 2, 8), torch.randn(P, 2, 8))
        assert cache.placement(slot)["compute"] == want[batch] * D
        cache.close()


def test_generate_announces_its_batch_before_prefill():
    rf = Roofline(a=3e-6, b=1e-6, c_cpu=0.0, c_gpu=2e-3)
    llm = LLM("tiny-qwen3-moe", progress=False)
    llm.set_policy("writescope", window=16, roofline=rf)
    prompts = [list(range(3, 3 + 256))] * 16
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
    n_cpu = math.floor(roofline_share(256 * 16, rf.a, rf.b, rf.c_cpu, rf.c_gpu) * 256 / 16 + 0.5)
    assert n_cpu < 16
    assert all(o.kv_placement["compute"] == n_cpu * 16 for o in outs)


def test_writescope_needs_a_roofline():
    with pytest.raises(ValueError, match="writescope calibrate"):
        parse_policy("writescope")


# ------------------------------------------------------------------ calibration
def test_calibration_measures_stores_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    layout, dev = KVLayout(2, 16, 16, False), torch.device("cpu")
    r, detail = calibrate(layout, 4, torch.float32, dev, window=16, batch=2, contexts=(64, 128, 256), steps=2, progress=False)
    assert r.a > 0 and r.b > 0 and r.c_cpu >= 0 and r.c_gpu >= 0
    # both sides measured together: per point, the CPU share's blocks on the CPU and the rest streamed
    want = [(2 * 16 * math.floor(r_ * L / 16 + 0.5), 2 * (L - 16 * math.floor(r_ * L / 16 + 0.5))) for r_ in (0.25, 0.5) for L in (64, 128, 256)]
    assert [(c[0], g[0]) for c, g in zip(detail["points"]["cpu"], detail["points"]["gpu"])] == want
    assert detail["shares"] == [0.25, 0.5] and detail["contexts"] == [64, 128, 256]
    # streaming alone (share 0) at each context, and the split's cost beyond its slower side
    assert [t for t, _ in detail["points"]["alone"]] == [2 * L for L in (64, 128, 256)]
    assert all(s > 0 for _, s in detail["points"]["alone"]) and len(detail["points"]["split_overhead"]) == 6
    assert [t for t, _ in detail["points"]["alone_gpu"]] == [2 * L for L in (64, 128, 256)]
    assert all(s > 0 for _, s in detail["points"]["alone_gpu"])
    assert r.b_alone > 0 and r.c_gpu_alone >= 0 and r.c_split == 0.0 and detail["loop_handover_s"] >= 0
    with pytest.raises(ValueError, match="both sides"):
        calibrate(layout, 4, torch.float32, dev, window=16, batch=2, contexts=(64, 128), steps=1, progress=False, shares=(0.0,))
    with pytest.raises(ValueError, match="lower batch") as e:  # the API's argument; the CLI says --batch
        calibrate(layout, 4, torch.float32, dev, window=16, batch=2, contexts=(2**40, 2**41), steps=1, progress=False)
    assert "lower --batch" in e.value.worded({})
    shape = shape_key(layout, 4, torch.float32, 16)
    assert load(dev, shape) is None
    path = save(dev, shape, r, detail)
    assert load(dev, shape) == r
    assert json.loads(path.read_text())  # valid JSON
    assert load_or_calibrate(layout, 4, torch.float32, dev, window=16, progress=False) == r  # no re-measure
    old = json.loads(path.read_text())  # an entry stored before the split check is measured again
    for key in ("b_alone", "c_gpu_alone", "c_split"):
        del old[next(iter(old))][shape][key]
    path.write_text(json.dumps(old))
    assert load(dev, shape) is None


def test_calibration_is_kept_per_cpu_attention_backend(tmp_path, monkeypatch):
    """A measured with torch's flash op is not used for the C++ kernel, nor the reverse, nor one
    kernel path's for another's."""
    from writescope.attention import cpu_kernel

    if not cpu_kernel.kernel_available():
        pytest.skip("no C++ compiler for the CPU attention kernel")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("WRITESCOPE_CPU_ATTENTION", "flash")
    dev, shape = torch.device("cpu"), "kv test"
    flash = Roofline(1e-9, 2e-9, 1e-4, 2e-4, 2e-9, 2e-4, 1e-5)
    save(dev, shape, flash, {})
    monkeypatch.setenv("WRITESCOPE_CPU_ATTENTION", "kernel")
    monkeypatch.setenv("WRITESCOPE_CPU_ISA", "portable")
    assert load(dev, shape) is None
    kernel = dataclasses.replace(flash, a=5e-10)
    save(dev, shape, kernel, {})
    assert load(dev, shape) == kernel
    if cpu_kernel.best_path() != "portable":
        monkeypatch.delenv("WRITESCOPE_CPU_ISA")  # the best path: another key
        assert load(dev, shape) is None
    monkeypatch.setenv("WRITESCOPE_CPU_ATTENTION", "flash")
    assert load(dev, shape) == flash


def test_calibration_fits_streaming_alone_from_its_device_time_and_keeps_the_loop_hand_over(monkeypatch):
    import writescope.scheduler.calibrate as cal

    def fake(layout, q_heads, dtype, device, window, share, batch, L, steps, cpu_threads):
        load = int((1 - share) * L)
        cpu_s, gpu_s = share * L * 4e-9 + 1e-3, load * 2e-9 + 5e-4  # each side's own time
        if share == 0:  # alone: its device time faster than the contended fit, its wall slower still
            return (0, 0.0), (load, load * 1.5e-9 + 2e-4), load * 1.7e-9 + 9e-4, 0.0
        return (L - load, cpu_s), (load, gpu_s), max(cpu_s, gpu_s) + 7e-4, 7e-4
    monkeypatch.setattr(cal, "_measure", fake)
    # 170 GB/s streaming alone: within these limits (tests/test_honest_measurements.py tries fits outside them)
    monkeypatch.setattr(cal.lim, "measure_limits", lambda device, nbytes: cal.lim.Limits(1000.0, 1000.0, "host read"))
    r, detail = cal.calibrate(KVLayout(2, 16, 16, False), 4, torch.float32, torch.device("cpu"), contexts=(1000, 2000, 4000), progress=False)
    assert r.a == pytest.approx(4e-9) and r.b == pytest.approx(2e-9) and r.c_cpu == pytest.approx(1e-3) and r.c_gpu == pytest.approx(5e-4)
    # from the device times, as the split's sides are (each its own timer), not from the walls
    assert r.b_alone == pytest.approx(1.5e-9) and r.c_gpu_alone == pytest.approx(2e-4)
    assert [s for _, s in detail["points"]["alone"]] == pytest.approx([L * 1.7e-9 + 9e-4 for L in (1000, 2000, 4000)])
    # the loop's hand-over is kept, but not as C_split: whole-model steps hide it (calibrate.py's docstring)
    assert r.c_split == 0.0 and detail["loop_handover_s"] == pytest.approx(7e-4) and detail["points"]["split_overhead"] == [7e-4] * 6


def test_calibrate_cli(tmp_path, monkeypatch, capsys):
    from writescope.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["calibrate", "--model", "tiny-qwen3-moe", "--batch", "2", "--window", "16", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "ns/token" in out and "r(L)" in out
    assert (tmp_path / "writescope" / "calibration.json").is_file()
    capsys.readouterr()
    assert main(["calibrate", "--model", "tiny-qwen3-moe", "--batch", "0"]) == 2
    err = capsys.readouterr().err
    assert "--batch must be >= 1, got 0" in err and "--window" not in err  # names only the bad flag


def test_fit_is_exact_on_a_line():
    from writescope.scheduler.calibrate import _fit

    a, c = _fit([(100, 0.5 + 100 * 2e-3), (300, 0.5 + 300 * 2e-3), (900, 0.5 + 900 * 2e-3)])
    assert a == pytest.approx(2e-3) and c == pytest.approx(0.5)
    assert math.isfinite(_fit([(100, 1.0), (100, 2.0)])[0])  # one x value: no division by zero


@pytest.mark.parametrize("policy, roofline", [("monolithic:0.5", None), ("monolithic", Roofline(a=2e-9, b=1e-9))])
def test_monolithic_baseline_gives_resident_tokens_and_prepares_every_step(policy, roofline):
    llm = LLM("tiny-qwen3-moe", progress=False)
    prompts = [list(range(3, 3 + n)) for n in (70, 33, 5)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm.set_policy(policy, window=16, roofline=roofline)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == ref
    assert all(o.kv_placement["load"] == 0 for o in outs)  # one physical state
    stats = llm.cache.decoder.stats
    assert stats.prepared_bytes > 0 and stats.prepare_seconds > 0 and stats.cpu_tokens > 0


def test_generate_records_the_r_trace(capsys, tmp_path):
    """The r(L) trace: one point before the first decode step and one per step. With a fixed
    target the placed share stays within one block of it; with ``writescope`` the target moves
    with the measured CPU cost (here a CPU far slower than the roofline given: it falls towards
    0) and the placed share follows only through new blocks (placed ones never move)."""
    llm = LLM("tiny-qwen3-moe", progress=False)
    prompts = [list(range(3, 3 + 256)), list(range(5, 5 + 256))]
    params = SamplingParams(max_tokens=61, ignore_eos=True)
    # writescope first: with no decode step run yet, neither O nor an in-step A is kept, so r = 0.25
    # until A and O are measured (O, milliseconds per layer here, would take the balance to 0)
    llm.set_policy("writescope", window=16, roofline=Roofline(a=3e-9, b=1e-9))
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    trace = llm.r_trace
    assert [p["step"] for p in trace] == list(range(61))
    assert trace[0]["target"] == pytest.approx(0.25) and trace[0]["deployed"] == 0.25
    assert trace[-1]["target"] < 0.1  # measured A >> 3 ns/token
    assert trace[-1]["deployed"] < trace[0]["deployed"]  # new blocks went to the load region
    llm.set_policy("static:0.25", window=16)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    trace = llm.r_trace
    assert [p["step"] for p in trace] == list(range(61))
    assert trace[-1]["L"] > trace[0]["L"] == 256
    for p in trace:
        assert p["target"] == 0.25 and abs(p["deployed"] - 0.25) <= 16 / p["L"] + 1e-9
    llm.set_policy("resident")
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=3))
    assert llm.r_trace is None


def test_generate_cli_prints_the_r_trace(tmp_path, capsys, monkeypatch):
    from writescope.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = tmp_path / "g.json"
    assert main(["generate", "--model", "tiny-qwen3-moe", "--prompt-ids", ",".join(["7"] * 100), "--max-new-tokens", "20",
                 "--policy", "static:0.5", "--window", "16", "--quiet", "--output-json", str(out)]) == 0
    assert "r(L) trace" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["r_trace"]) == 20
