"""The evaluation's headline from saved grids (writescope/bench/headline.py)."""

from __future__ import annotations

import math

import dataclasses

import pytest

from writescope.bench.headline import TARGET, format_headline, headline, plot_headline
from writescope.bench.runner import BenchRow


def _row(c, policy, tok_s, bound=0.0, repeat=0, fits=True):
    """Batch 4 at ``tok_s`` decode tokens per second: a TPOT of 4,000 / tok_s ms (what the headline compares);
    the engine's own decode_tok_s is set apart from it, and must not be what is compared."""
    return BenchRow(4, c, policy, fits=fits, decode_tok_s=1.0, tpot_ms=4e3 / tok_s if tok_s else 0.0, step_bound_ms=bound,
                    extra={"repeat": repeat})


def _grid():
    # 4K is below the headline's 8K; at 8K the best baseline is gpu, at 16K static:0.5; every baseline present
    return [
        _row(4096, "gpu", 10.0), _row(4096, "writescope", 100.0),
        _row(8192, "gpu", 10.0), _row(8192, "static:0.5", 8.0), _row(8192, "cpu", 2.0), _row(8192, "writescope", 20.0, 100.0),
        _row(16384, "gpu", 5.0), _row(16384, "static:0.5", 6.0), _row(16384, "cpu", 1.0), _row(16384, "writescope", 9.0, 200.0),
    ] + [_row(c, p, 0.5) for c in (8192, 16384) for p in ("monolithic", "static:0.25")]


def test_the_headline_is_the_geometric_mean_over_the_best_baseline_at_8k_and_beyond():
    h = headline("m", _grid())
    assert h.configurations == 2
    assert h.over_best == pytest.approx(math.sqrt(20 / 10 * 9 / 6))  # 2.0 at 8K (gpu), 1.5 at 16K (static:0.5)
    assert h.over_gpu == pytest.approx(math.sqrt(2.0 * 1.8))
    assert h.best_baseline in ("gpu", "static:0.5")  # one cell each
    assert h.x_bound == pytest.approx((200 / 100 + 4e3 / 9 / 200) / 2)  # TPOT over the bound; the median of two: their mean
    table = format_headline([h, headline("n", [_row(8192, "gpu", 10.0), _row(8192, "writescope", 11.0)], source="n.json")])
    lines = table.splitlines()
    assert lines[0].startswith("| model | grid | configurations (context >= 8K)") and f"target {TARGET}x" in lines[0]
    assert f"**{h.over_best:.2f}x**" in lines[2] and lines[2].endswith("| met |")
    assert lines[3].startswith("| n | n.json | 1 | gpu | **1.10x** |") and "| - | not met |" in lines[3]  # one run: no spread
    assert "predate the bench's bound measurement" in table


def test_configurations_where_writescope_loses_beyond_the_noise_are_named():
    rows = [_row(8192, "gpu", 10.0, repeat=0), _row(8192, "gpu", 10.4, repeat=1),
            _row(8192, "writescope", 7.0, repeat=0), _row(8192, "writescope", 7.5, repeat=1),  # below in every run
            _row(16384, "gpu", 10.0, repeat=0), _row(16384, "gpu", 12.0, repeat=1),
            _row(16384, "writescope", 9.0, repeat=0), _row(16384, "writescope", 11.0, repeat=1)]  # within the noise
    h = headline("m", rows)
    # the runs the table shows (of median TPOT: the slower for two), the interval over all runs
    assert h.below == [f"4x8K: {7.0 / 10.0:.2f}x gpu [{7.0 / 10.4:.2f}-{7.5 / 10.0:.2f}]"]
    assert "slower than the best baseline beyond the noise in 1 of 2 configurations: 4x8K" in format_headline([h])
    assert headline("m", _grid()).below == [] and "beyond the noise" not in format_headline([headline("m", _grid())])


def test_the_headline_takes_tpot_over_the_joint_bound_where_experts_live_in_host_memory():
    ws = _row(8192, "writescope", 20.0, 100.0)  # TPOT 200 ms, KV bound 100 ms
    ws.joint_step_bound_ms = 160.0  # with the host experts it hits
    assert headline("m", [_row(8192, "gpu", 10.0), ws]).x_bound == pytest.approx(200 / 160)


def test_a_row_without_a_tpot_is_no_baseline():
    rows = [_row(8192, "gpu", 0.0), _row(8192, "gpu", 10.0, repeat=1), _row(8192, "writescope", 20.0)]
    assert headline("m", rows).over_best == pytest.approx(2.0)  # the gpu row with no TPOT left out, not a division by 0


def test_a_model_whose_writescope_never_ran_says_so():
    h = headline("m", [_row(8192, "gpu", 10.0), _row(8192, "writescope", 0.0, fits=False)])
    assert h.over_best is None and h.x_bound is None
    table = format_headline([h])
    assert "| m | - | 0 | gpu | - | - | - | - |" in table and "no configuration with context >= 8192" in table


def test_the_headline_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "h.png"
    plot_headline([headline("m", _grid())], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_models_grids_are_told_apart_by_their_batches():
    from writescope.bench.headline import _grid_label

    h = headline("m", _grid(), source="gpu_decode_h200_run58_grid_m_b4.json")
    assert h.batches == [4]  # the 4K cells are below the floor, and batch 4 too
    assert _grid_label("m", h) == "batch 4"
    h.batches = [4, 16]
    assert _grid_label("m", h) == "batch 4, 16"
    h.batches = []  # no configuration at >= 8K: the file names it
    assert _grid_label("m", dataclasses.replace(h, source="grid_m_h200_run40_b16.json")) == "h200_run40_b16"


def test_a_grid_without_every_baseline_cannot_show_the_target_met():
    """Issue 17's baselines are gpu, cpu, monolithic and a static sweep: a grid at or above the
    target that lacks one says so instead of "met"; below the target it is "not met" (a baseline
    not run could only be faster)."""
    from writescope.bench.headline import missing_baselines, target_status

    assert missing_baselines(["gpu", "cpu", "monolithic", "static:0.25", "static:0.5", "writescope"]) == []
    assert missing_baselines(["gpu", "cpu", "monolithic", "static:0", "static:1", "static:0.5"]) == ["static sweep"]
    assert missing_baselines(["gpu", "cpu", "writescope", "static:0.5"]) == ["monolithic", "static sweep"]
    assert missing_baselines(["writescope"]) == ["gpu", "cpu", "monolithic", "static sweep"]
    fast = [_row(8192, "gpu", 10.0), _row(8192, "cpu", 9.0), _row(8192, "writescope", 20.0)]
    h = headline("m", fast)
    assert h.over_best == pytest.approx(2.0) and h.missing == ["monolithic", "static sweep"]
    assert target_status(h) == "not shown (no monolithic, no static sweep)"
    assert "| met |" not in format_headline([h])
    slow = headline("m", [_row(8192, "gpu", 10.0), _row(8192, "writescope", 11.0)])
    assert target_status(slow) == "not met"
    assert target_status(headline("m", _grid())) == "met"


def test_a_baseline_run_in_one_cell_only_is_missing_in_the_others():
    from writescope.bench.headline import target_status

    rows = [r for r in _grid() if not (r.context == 16384 and r.policy == "monolithic")]  # monolithic at 8K only
    assert headline("m", _grid()).missing == []
    h = headline("m", rows)
    assert h.missing == ["monolithic"] and target_status(h).startswith("not shown (no monolithic")


def test_a_cuda_grid_whose_steps_hit_host_experts_needs_a_fixed_share_computing_them_on_the_cpu():
    """On CUDA fixed policies read host experts in place by default, while writescope splits them
    between streaming and the CPU each step: without a fixed row that computes them on the CPU
    (``@expert_stream_share=0``) the grid cannot show the target met (Mixtral, runs 43-44)."""
    from writescope.bench.headline import CPU_EXPERTS, computes_host_experts_on_cpu, missing_baselines, target_status

    assert computes_host_experts_on_cpu("static:0.5@expert_stream_share=0")
    assert computes_host_experts_on_cpu("cpu@WRITESCOPE_MICRO_BATCHES=2+expert_stream_share=0.0")
    assert not computes_host_experts_on_cpu("static:0.5@expert_stream_share=0.5")
    assert not computes_host_experts_on_cpu("writescope@expert_stream_share=0")  # not a fixed policy
    assert not computes_host_experts_on_cpu("static:0.5") and not computes_host_experts_on_cpu("gpu@expert_stream_share=x")
    full = ["gpu", "cpu", "monolithic", "static:0.25", "static:0.5", "writescope"]
    assert missing_baselines(full, host_experts=True) == [CPU_EXPERTS]
    assert missing_baselines(full + ["static:0.5@expert_stream_share=0"], host_experts=True) == []
    assert missing_baselines(full, host_experts=False) == []

    rows = _grid()
    for r in rows:
        r.host_expert_bytes = 1e9 if r.context == 16384 else 0.0  # hit only in the 16K cell
    assert headline("m", rows).missing == []  # no device named: a CPU grid, whose experts are all on the CPU
    h = headline("m", rows, device="cuda")
    assert h.missing == [CPU_EXPERTS] and target_status(h) == f"not shown (no {CPU_EXPERTS})"
    assert headline("m", rows, device="cuda", expert_stream_share=0.0).missing == []  # every row computed them on the CPU
    rows.append(_row(16384, "cpu@expert_stream_share=0", 0.5))
    assert headline("m", rows, device="cuda").missing == []
    assert headline("m", rows, device="cuda").over_best == pytest.approx(math.sqrt(20 / 10 * 9 / 6))  # slower: no change
    rows.append(_row(16384, "static:0.5@expert_stream_share=0", 7.5))  # faster than static:0.5 at 16K: the best baseline there
    h = headline("m", rows, device="cuda")
    assert h.over_best == pytest.approx(math.sqrt(20 / 10 * 9 / 7.5)) and h.best_baseline in ("gpu", "static:0.5@expert_stream_share=0")
    from writescope.bench.report import CPU_EXPERTS as CPU_EXPERTS_BASELINE, format_speedups, speedups

    assert speedups(rows)[CPU_EXPERTS_BASELINE] == (pytest.approx(9 / 7.5), 1)  # one cell has such rows
    assert "best static, CPU experts 1.20x (1)" in format_speedups(rows)
