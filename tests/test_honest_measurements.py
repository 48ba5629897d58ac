"""Measurements that cannot be true are not printed as facts (issue 19 item 4): calibration fits
outside the machine's physical limits are measured again, then clamped and flagged; bench says
how far its repeats spread and when a ratio is within that noise."""

from __future__ import annotations

import pytest
import torch

import writescope.scheduler.calibrate as cal
from writescope.config import KVLayout
from writescope.scheduler import limits as lim

LAYOUT = KVLayout(2, 16, 16, False)  # 256 bytes per token in fp32
TOKEN_BYTES = 256
FAKE_LIMITS = lim.Limits(10.0, 10.0, "host read")  # GB/s: fits may reach 20 GB/s (READ_MARGIN 2)


def _fake(alone_passes: list[str], calls: list[float]):
    """A ``_measure`` whose split points are plausible (A 40 ns/token = 6.4 GB/s, B 20 ns/token)
    and whose streaming-alone points are, pass by pass, "flat" (no growth with the tokens, as
    the CPU machine measured) or "line" (12.8 GB/s + 0.2 ms)."""

    def measure(layout, q_heads, dtype, device, window, share, batch, L, steps, cpu_threads):
        calls.append(share)
        load = int((1 - share) * L)
        if share == 0:
            kind = alone_passes[min(len(alone_passes) - 1, (calls.count(0.0) - 1) // 3)]
            wall = 5e-3 if kind == "flat" else load * 20e-9 + 2e-4
            return (0, 0.0), (load, wall), wall, 0.0
        cpu_s, gpu_s = (L - load) * 40e-9 + 1e-3, load * 20e-9 + 5e-4
        return (L - load, cpu_s), (load, gpu_s), max(cpu_s, gpu_s) + 7e-4, 7e-4

    return measure


@pytest.fixture
def fake_limits(monkeypatch):
    monkeypatch.setattr(lim, "measure_limits", lambda device, nbytes: FAKE_LIMITS)


def _calibrate():
    return cal.calibrate(LAYOUT, 4, torch.float32, torch.device("cpu"), contexts=(1000, 2000, 4000), progress=False)


def test_problems_names_what_cannot_be_true():
    flat = [(1000, 5e-3), (2000, 5e-3), (4000, 5e-3)]
    found = lim.problems("B alone", flat, TOKEN_BYTES, 20.0, "the limit")
    assert any("does not grow with the tokens" in p for p in found)
    fast = [(1000, 1e-3 + 1000 * 1e-9), (4000, 1e-3 + 4000 * 1e-9)]  # 256 GB/s
    assert lim.problems("A", fast, TOKEN_BYTES, 20.0, "2x the read rate") == [
        "A: 1.000 ns/token = 256.0 GB/s is faster than 2x the read rate (20.0 GB/s)"]
    steep = [(1000, 2e-3), (2000, 1e-3), (4000, 2.1e-3)]  # a line whose intercept is above the fastest step
    assert any("more than the fastest step" in p for p in lim.problems("C", steep, TOKEN_BYTES, 1e9, "x"))
    good = [(1000, 2e-4 + 1000 * 20e-9), (4000, 2e-4 + 4000 * 20e-9)]
    assert lim.problems("B", good, TOKEN_BYTES, 20.0, "x") == []
    assert lim.clamped(good, TOKEN_BYTES, 20.0) == pytest.approx((20e-9, 2e-4))
    # a flat line held at the limit's slope passes through the points' mean (7/3 of 1000 tokens)
    assert lim.clamped(flat, TOKEN_BYTES, 20.0) == pytest.approx((TOKEN_BYTES / 20e9, 5e-3 - TOKEN_BYTES / 20e9 * 7000 / 3))
    # a fit faster than the limit: the slope held, the fixed cost fitted again for it (not kept)
    fast_line = [(x, 1e-3 + x * 1e-9) for x in (1000, 2000, 4000)]  # 256 GB/s at 256 bytes a token
    s, c = lim.clamped(fast_line, TOKEN_BYTES, 20.0)
    assert s == pytest.approx(TOKEN_BYTES / 20e9)
    assert c == pytest.approx(max(0.0, sum(y - s * x for x, y in fast_line) / 3)) and c < 1e-3


def test_an_impossible_fit_is_measured_again_then_kept(monkeypatch, fake_limits):
    calls: list[float] = []
    monkeypatch.setattr(cal, "_measure", _fake(["flat", "line"], calls))
    r, detail = _calibrate()
    assert calls.count(0.0) == 6 and len(calls) == 12, "streaming alone measured twice, the split shares once"
    assert detail["implausible"] == []
    assert r.b_alone == pytest.approx(20e-9) and r.c_gpu_alone == pytest.approx(2e-4)  # the second pass
    assert r.a == pytest.approx(40e-9) and r.b == pytest.approx(20e-9)
    assert detail["limits"] == {"host_read_gbs": 10.0, "load_gbs": 10.0, "load_path": "host read", "read_bytes": 0}


def test_a_fit_still_impossible_after_the_remeasure_is_clamped_and_flagged(monkeypatch, fake_limits):
    calls: list[float] = []
    monkeypatch.setattr(cal, "_measure", _fake(["flat"], calls))
    r, detail = _calibrate()
    assert calls.count(0.0) == 6 and len(calls) == 12
    assert len(detail["implausible"]) == 1 and "does not grow with the tokens" in detail["implausible"][0]
    assert detail["implausible"][0].startswith("B alone and C_gpu alone (streaming alone): ")
    # no faster than the limit (2 x 10 GB/s), the fixed cost fitted again for that slope (through the mean)
    assert r.b_alone == pytest.approx(TOKEN_BYTES / 20e9) and r.c_gpu_alone == pytest.approx(5e-3 - TOKEN_BYTES / 20e9 * 7000 / 3)
    assert r.a == pytest.approx(40e-9)  # the plausible fits are left as they are


def test_a_first_use_calibration_with_a_clamped_fit_says_what_to_do(tmp_path, monkeypatch, fake_limits):
    """generate's first writescope run calibrates on the way: a clamped fit warns in words a
    newcomer can act on (the run goes on; calibrate again on a quieter machine), the details after."""
    monkeypatch.setattr(cal, "store_path", lambda: tmp_path / "calibration.json")
    monkeypatch.setattr(cal, "_measure", _fake(["flat"], []))
    real = cal.calibrate
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: real(*a, **dict(k, contexts=(1000, 2000, 4000))))
    monkeypatch.setattr(cal, "actionable", lambda bad, device: bad)  # as on a GPU machine: the B fit is a GPU's
    with pytest.warns(UserWarning) as got:
        cal.load_or_calibrate(LAYOUT, 4, torch.float32, "cpu", progress=False)
    text = str(got[0].message)
    assert text.startswith("calibration: 1 fit(s) CLAMPED to this machine's limits")
    assert "The run goes on" in text and "`writescope calibrate` on a quieter machine" in text
    assert "Details: B alone and C_gpu alone" in text


def test_a_clamped_gpu_side_fit_without_a_gpu_is_not_a_warning(tmp_path, monkeypatch, fake_limits, recwarn):
    """On the CPU the "GPU" side is CPU tensors: its clamped fits (B, B alone) are expected and give
    no warning a user cannot act on (a new user saw one); a clamped A still does, and on a GPU
    machine every one does."""
    monkeypatch.setattr(cal, "store_path", lambda: tmp_path / "calibration.json")
    monkeypatch.setattr(cal, "_measure", _fake(["flat"], []))
    real = cal.calibrate
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: real(*a, **dict(k, contexts=(1000, 2000, 4000))))
    cal.load_or_calibrate(LAYOUT, 4, torch.float32, "cpu", progress=False)
    assert not [w for w in recwarn if "CLAMPED" in str(w.message)]
    found = ["A and C_cpu (CPU, compute region): x", "B and C_gpu (GPU, load region): y", "B alone and C_gpu alone: z"]
    assert cal.actionable(found, "cpu") == found[:1]
    assert cal.actionable(found, torch.device("cuda")) == found


def test_calibrate_cli_flags_a_clamped_fit(tmp_path, monkeypatch, capsys, fake_limits):
    from writescope.cli.main import main

    monkeypatch.setattr(cal, "store_path", lambda: tmp_path / "calibration.json")
    monkeypatch.setattr(cal, "_measure", _fake(["flat"], []))
    assert main(["calibrate", "--model", "tiny-qwen3-moe", "--device", "cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    alone = next(ln for ln in out.splitlines() if ln.strip().startswith("B alone"))
    assert "CLAMPED" in alone and "GB/s" in alone
    # on the CPU a clamped "GPU" side is expected: a note, no warning (on a GPU machine: the warning)
    assert "WARNING" not in out and "note: the 'GPU' side's fits above are CPU tensors' and were clamped" in out
    monkeypatch.setattr(cal, "actionable", lambda bad, device: bad)
    assert main(["calibrate", "--model", "tiny-qwen3-moe", "--device", "cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: 1 fit(s) stayed outside this machine's physical limits" in out
    assert "does not grow with the tokens" in out and "limits here: host read 10.0 GB/s" in out
    # the limit it was held to is printed with its margin (2 x 10 GB/s), not only the measured 10
    assert "a [CLAMPED] fit is held to: A at most 2x this machine's host read rate of 10.0 GB/s = 20.0 GB/s" in out
    a_line = next(ln for ln in out.splitlines() if ln.strip().startswith("A (CPU"))
    assert "CLAMPED" not in a_line


def test_the_host_read_limit_names_the_buffer_it_read(tmp_path, monkeypatch, capsys):
    """The host read limit is measured on a buffer the size of the calibration's largest KV (a
    tiny model's stays in the CPU's caches, as its KV does): calibrate says how large, so a cached
    rate is not read as the memory's."""
    from writescope.cli.main import main

    limits = lim.measure_limits(torch.device("cpu"), 3 * 2**20)
    assert limits.read_bytes == lim.MIN_BYTES  # raised to the smallest buffer measured
    monkeypatch.setattr(cal.lim, "measure_limits", lambda device, nbytes: lim.Limits(10.0, 10.0, "host read", 16 * 2**20))
    monkeypatch.setattr(cal, "store_path", lambda: tmp_path / "calibration.json")
    monkeypatch.setattr(cal, "_measure", _fake(["flat"], []))
    assert main(["calibrate", "--model", "tiny-qwen3-moe", "--device", "cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "limits here: host read 10.0 GB/s (measured; the host read of 16 MiB, the largest KV calibrated here" in out


def test_a_pinned_copy_rate_bounds_the_streamed_slope_within_five_percent():
    """The streamed side may not beat the measured pinned copy by more than 5% (run 11 on the
    H200: B at 73.0 GB/s in a split step, 1.32x the 55.4 GB/s copy, passed the old 1.5x margin)."""
    link = lim.Limits(100.0, 55.4, "pinned host-to-device copy")
    assert link.max_gbs("load")[0] == pytest.approx(1.05 * 55.4)
    per_token = 1152  # the MLA latent in bf16
    b = 15.774e-9  # run 11's slope: 73.0 GB/s
    pts = [(L, L * b + 6.67e-4) for L in (8192, 32768, 131072)]
    found = lim.problems("B and C_gpu", pts, per_token, *link.max_gbs("load"))
    assert found and "73.0 GB/s is faster than 1.05x this machine's pinned host-to-device copy rate of 55.4 GB/s" in found[0]
    slope, _ = lim.clamped(pts, per_token, link.max_gbs("load")[0])
    assert per_token / slope / 1e9 == pytest.approx(1.05 * 55.4)


def test_measured_limits_are_positive():
    got = lim.measure_limits(torch.device("cpu"), 1)
    assert got.host_read > 0 and got.load == got.host_read and got.load_path == "host read"


# ------------------------------------------------------------------ bench: spread over repeats
def _row(c, policy, tok_s, attn_ms, repeat=0):
    from writescope.bench.runner import BenchRow

    return BenchRow(1, c, policy, decode_tok_s=tok_s, tpot_ms=1e3 / tok_s, attn_ms_per_layer=attn_ms, r_deployed=0.5 if policy == "writescope" else 0.0,
                    extra={"repeat": repeat})


# per (context, policy): decode tok/s and attention ms of three runs. writescope's attention is
# clearly twice as fast as gpu's; its decode tok/s is not told apart from gpu's by the runs.
RUNS = {
    (8192, "gpu"): ([10.0, 10.4, 9.8], [2.0, 2.1, 1.9]),
    (8192, "writescope"): ([10.5, 9.5, 10.0], [1.0, 1.02, 0.98]),
    (16384, "gpu"): ([5.0, 5.1, 4.9], [4.0, 4.1, 3.9]),
    (16384, "writescope"): ([10.0, 10.2, 9.8], [2.0, 2.05, 1.95]),
}


def _rows(runs=RUNS, repeats=3):
    return [_row(c, p, tok[i], attn[i], i) for (c, p), (tok, attn) in runs.items() for i in range(repeats)]


def test_ratio_interval_and_noise():
    from writescope.bench.report import format_ratio, ratio

    assert ratio([2.0, 2.1, 1.9], [1.0, 1.02, 0.98]) == pytest.approx((2.0, 1.9 / 1.02, 2.1 / 0.98))
    assert format_ratio(*ratio([2.0, 2.1, 1.9], [1.0, 1.02, 0.98])) == "2.00x [1.86-2.14]"
    assert format_ratio(*ratio([10.5, 9.5, 10.0], [10.0, 10.4, 9.8])) == "1.00x [0.91-1.07, within the noise]"
    assert format_ratio(*ratio([93.28], [1.0])) == "93.28x"  # one run each: no interval


def test_bench_report_gives_each_ratio_its_spread_and_says_when_it_is_noise():
    from writescope.bench.report import format_best, format_speedups, format_table, speedup_spread, speedups

    rows = _rows()
    best = format_best(rows)
    assert "batch 1 context 8192: best gpu (2.00 ms)" in best
    assert "attention 2.04x [1.86-2.14], decode 1.00x [0.91-1.07, within the noise] over gpu" in best
    assert "one run per configuration" not in best
    table = format_table(rows)
    assert len(table.splitlines()) == 1 + 4 + 3, "one line per configuration and policy, medians, and the three notes"
    assert "(r: the CPU's share of the batch's placed KV" in table
    assert "10.0 ±5%" in table and "±: half their spread" in table  # writescope 8192: (10.5 - 9.5) / 2 / 10
    s, spread = speedups(rows), speedup_spread(rows)
    assert s["gpu"] == (pytest.approx((1.0 * 2.0) ** 0.5), 2)
    assert spread["gpu"] == pytest.approx(((9.5 / 10.4 * 9.8 / 5.1) ** 0.5, (10.5 / 9.8 * 10.2 / 4.9) ** 0.5))
    assert "gpu 1.41x (2) [1.32-1.49]" in format_speedups(rows)
    # an interval holding 1 is within the noise
    noisy = {**RUNS, (16384, "gpu"): ([10.0, 12.0, 8.0], [2.0, 2.1, 1.9])}
    assert "gpu 1.00x (2) [0.86-1.17, within the noise]" in format_speedups(_rows(noisy))


def test_bench_report_says_a_difference_at_r_0_is_between_runs():
    """writescope at r 0 places every block as gpu does: a decode ratio beyond the noise there is
    the runs', and the line says so; within the noise, or at a split, it says nothing more."""
    from writescope.bench.report import format_best

    def rows(runs, r):
        out = _rows(runs)
        for row in out:
            if row.policy == "writescope":
                row.r_deployed = r
        return out

    apart = {(8192, "gpu"): ([10.0, 10.4, 9.8], [2.0, 2.1, 1.9]), (8192, "writescope"): ([11.5, 11.4, 11.6], [1.9, 2.0, 1.8])}
    note = "r 0 is gpu's placement, so this difference is between runs, not policies"
    assert note in format_best(rows(apart, 0.0))
    assert note not in format_best(rows(apart, 0.25))
    by_context = {ln.split(":")[0]: ln for ln in format_best(rows(RUNS, 0.0)).splitlines()}
    assert note not in by_context["  batch 1 context 8192"]  # decode within the noise there
    assert note in by_context["  batch 1 context 16384"]


def test_bench_report_without_repeats_says_no_spread_was_measured():
    from writescope.bench.report import format_best

    one = format_best(_rows({(8192, "gpu"): ([1.0], [93.28]), (8192, "writescope"): ([0.17], [1.0])}, repeats=1))
    assert "attention 93.28x, decode 0.17x over gpu" in one
    assert "one run per configuration: no spread measured, a ratio may be noise; --repeats 3 measures it" in one


def test_bench_cli_repeats_every_configuration_with_the_policies_taking_turns(tmp_path, monkeypatch, capsys):
    """The CLI's --repeats reaches the grid, each run is a row, and the printed ratios carry their
    intervals (a stub engine and measured values: nothing here depends on this machine's timing)."""
    import json
    import types

    import writescope.bench.runner as runner
    import writescope.engine.llm as engine
    from writescope.cli.main import main
    from writescope.kvcache.spec import Roofline

    class StubLLM:
        def __init__(self, model, **kw):
            self.config, self.vram_plan = types.SimpleNamespace(num_layers=2), None
            self.device, self.dtype = torch.device("cpu"), torch.float32

        def roofline(self, window):
            return Roofline(1e-9, 1e-9)

        def stored_calibration(self, window):
            return None

    order = []

    def run_one(llm, cfg, batch, context, policy, roofline=None):
        if cfg.warmup is False:  # the unmeasured warm-up runs
            return runner.BenchRow(batch, context, policy)
        i = sum(1 for c, p in order if (c, p) == (context, policy))
        order.append((context, policy))
        tok, attn = RUNS[(context, policy)]
        return _row(context, policy, tok[i], attn[i])

    monkeypatch.setattr(engine, "LLM", StubLLM)
    monkeypatch.setattr(runner, "run_one", run_one)
    import writescope.engine.model_loader as loader  # the stub stands for a model with room for 16K (tiny has 8,192)

    monkeypatch.setattr(loader, "capped_model_len", lambda model, tokens, *a, **k: tokens)
    out = tmp_path / "b.json"
    assert main(["bench", "--model", "tiny-qwen3-moe", "--batch", "1", "--context", "8k,16k", "--policies", "gpu,writescope",
                 "--quiet", "--output-json", str(out)]) == 0  # --repeats 3 by default
    # the policies take turns: rotated by one place each repeat (runner.policy_turn)
    assert order == [(c, p) for c in (8192, 16384) for p in ("gpu", "writescope", "writescope", "gpu", "gpu", "writescope")]
    printed = capsys.readouterr().out
    assert "3 runs of each" in printed
    assert "attention 2.04x [1.86-2.14], decode 1.00x [0.91-1.07, within the noise] over gpu" in printed
    assert "gpu 1.41x (2) [1.32-1.49]" in printed
    doc = json.loads(out.read_text())
    assert doc["complete"] and [r["extra"]["repeat"] for r in doc["rows"]] == [0, 0, 1, 1, 2, 2] * 2
    assert doc["speedups_geomean_8k"]["gpu"]["min_max_over_repeats"] == pytest.approx(list(speedup_spread_of(doc)))


def speedup_spread_of(doc):
    return ((9.5 / 10.4 * 9.8 / 5.1) ** 0.5, (10.5 / 9.8 * 10.2 / 4.9) ** 0.5)
