"""The bound rates a benchmark measures in its own run (writescope/bench/bounds.py), and how the
rows and the table use them."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import half_experts_budget
from writescope.bench import bounds


def test_the_host_buffer_outsizes_the_last_level_cache():
    llc = bounds.last_level_cache_bytes()
    n = bounds.read_bytes_default()
    assert bounds.MIN_READ_BYTES <= n <= bounds.MAX_READ_BYTES
    if llc is not None:
        assert llc > 0 and (n >= bounds.CACHE_MULTIPLE * llc or n == bounds.MAX_READ_BYTES)


def test_rates_without_a_link_are_the_host_read():
    r = bounds.measure(torch.device("cpu"), read_bytes=8 * 2**20, repeats=1)
    assert r.cpu_alone > 0 and r.h2d_alone is None and r.cpu_with_h2d is None
    assert r.split_gbs() == r.stream_gbs() == r.cpu_alone
    assert "measured in this run" in r.source and "no link" in r.line()


def test_the_split_uses_the_contended_rates_where_measured():
    both = bounds.Rates(cpu_alone=116.4, h2d_alone=55.1, cpu_with_h2d=76.8, h2d_with_cpu=52.7, source="x")
    assert both.split_gbs() == pytest.approx(129.5) and both.stream_gbs() == 55.1
    line = both.line()
    assert "host-to-GPU 55.1 GB/s alone" in line and "at once: host-to-GPU 52.7 and CPU 76.8" in line and "split bound 129.5" in line
    alone_only = bounds.Rates(cpu_alone=86.0, h2d_alone=55.0)
    assert alone_only.split_gbs() == 141.0  # given rates: taken as reached at once


def test_given_rates_are_checked():
    assert bounds.given(55.0, 86.0, cuda=True).split_gbs() == 141.0
    assert bounds.given(55.0, 86.0, cuda=False).split_gbs() == 86.0  # no link without CUDA
    with pytest.raises(ValueError, match="--h2d-gbs must be a positive rate in GB/s, got 0"):
        bounds.given(0.0, 86.0, cuda=True)
    with pytest.raises(ValueError, match="--cpu-gbs must be a positive rate in GB/s, got -1"):
        bounds.given(55.0, -1.0, cuda=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measured_rates_on_cuda_are_all_there_and_nothing_stays_reserved():
    """Every rate is measured (no rate is compared with another: they move with the machine's
    load), and the measurement leaves no device memory reserved."""
    before = torch.cuda.memory_reserved()
    r = bounds.measure(torch.device("cuda"), read_bytes=256 * 2**20, copy_bytes=64 * 2**20, repeats=2)
    assert r.h2d_alone > 0 and r.cpu_alone > 0 and r.h2d_with_cpu > 0 and r.cpu_with_h2d > 0
    assert r.split_gbs() == r.h2d_with_cpu + r.cpu_with_h2d and r.stream_gbs() == r.h2d_alone
    assert torch.cuda.memory_reserved() <= before  # the copy target released (empty_cache may release more)


def test_bench_measures_its_bounds_and_rows_carry_them(tmp_path, capsys):
    """The bench measures its rates, and each row's bounds count the KV in host memory only:
    ``resident`` (all KV on the device) has none; a partitioned policy's is its KV less the
    D-window, over the measured rate, for every layer."""
    from writescope.cli.main import main

    out = tmp_path / "b.json"
    assert main(["bench", "--model", "tiny-qwen3-moe", "--device", "cpu", "--batch", "2", "--context", "64", "--steps", "2",
                 "--window", "16", "--policies", "gpu,static:0.5,resident", "--repeats", "1", "--quiet", "--kv-fill", "random",
                 "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bound rates (measured in this run" in printed and "x bound" in printed and "the step's host-resident KV takes" in printed
    assert "work outside attention per decode layer step (O, measured in decode steps" in printed and "batch 2 " in printed
    doc = json.loads(out.read_text())
    rates = doc["bound_rates"]
    assert rates["cpu_alone"] > 0 and rates["h2d_alone"] is None and rates["source"].startswith("measured in this run")
    rows = {r["policy"]: r for r in doc["rows"]}
    assert rows["resident"]["step_bound_ms"] == 0.0 and rows["resident"]["bound_ms"] == 0.0
    for name in ("gpu", "static:0.5"):
        row = rows[name]
        host_bytes = row["step_bound_ms"] / 1e3 * rates["cpu_alone"] * 1e9 / doc["num_layers"]
        # 2 sequences of 64 + 1 cached tokens on average, at most 16 + 2 of each in the D-window
        assert row["kv_bytes_per_layer"] * (65 - 18) / 65 <= host_bytes * (1 + 1e-9) and host_bytes < row["kv_bytes_per_layer"]
        assert row["stream_step_bound_ms"] == pytest.approx(row["step_bound_ms"])  # no link: one rate


def test_bench_takes_given_rates_and_checks_them_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import writescope.engine.llm as engine
    from writescope.cli.main import main

    out = tmp_path / "b.json"
    assert main(["bench", "--model", "tiny-qwen3-moe", "--device", "cpu", "--batch", "1", "--context", "48", "--steps", "1",
                 "--window", "16", "--policies", "gpu", "--repeats", "1", "--quiet", "--kv-fill", "random",
                 "--output-json", str(out), "--h2d-gbs", "50", "--cpu-gbs", "100"]) == 0
    assert "bound rates (given)" in capsys.readouterr().out
    rates = json.loads(out.read_text())["bound_rates"]
    assert rates["source"] == "given" and rates["cpu_alone"] == 100.0 and rates["h2d_alone"] is None  # the CPU run has no link

    def no_model(*a, **k):
        raise AssertionError("the model was built before the rates were checked")

    monkeypatch.setattr(engine.LLM, "__init__", no_model)
    assert main(["bench", "--model", "tiny-qwen3-moe", "--h2d-gbs", "50"]) != 0
    assert "give both --h2d-gbs and --cpu-gbs, or neither" in capsys.readouterr().err
    assert main(["bench", "--model", "tiny-qwen3-moe", "--h2d-gbs", "0", "--cpu-gbs", "80"]) != 0
    assert "--h2d-gbs must be a positive rate in GB/s, got 0" in capsys.readouterr().err


def test_a_grid_no_row_of_which_fits_the_model_is_refused_before_it_loads(capsys, monkeypatch):
    import writescope.engine.llm as engine
    from writescope.cli.main import main

    def no_model(*a, **k):
        raise AssertionError("the model was built for a grid that cannot fit")

    monkeypatch.setattr(engine.LLM, "__init__", no_model)
    assert main(["bench", "--model", "tiny-qwen3-moe", "--context", "8k", "--steps", "4"]) != 0
    err = capsys.readouterr().err
    assert "--context 8,192: with --steps 4 a request reaches 8,197 tokens, beyond the 8,192 positions" in err
    assert "use a --context of at most 8,187" in err


def test_rows_of_a_model_with_host_experts_carry_the_joint_bound():
    """Where routed experts live in host memory, a row's bound holds the step's expected hit host
    expert bytes beside its host KV (issue 16's joint bound), and x bound is taken over it."""
    from writescope import LLM
    from writescope.bench.report import format_table
    from writescope.bench.runner import BenchConfig, run_one
    from writescope.scheduler.expert_work import expected_host_expert_bytes

    half = half_experts_budget()  # half the experts on the host
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, vram_budget=half, max_batch=2)
    rates = bounds.given(10.0, 20.0, cuda=False)
    row = run_one(llm, BenchConfig([2], [64], ["static:0.5"], steps=2, window=16, warmup=False, kv_fill="random", rates=rates),
                  2, 64, "static:0.5")
    assert row.fits and row.step_bound_ms > 0
    assert row.extra["other_work_ms"] == llm.other_work.seconds(2) * 1e3  # O as the gate saw it, kept with the row
    assert row.extra["pinned"] == {"register_s": 0.0, "register_bytes": 0, "unregister_s": 0.0, "unregister_bytes": 0,
                                   "reused": 0, "reused_bytes": 0}  # no CUDA
    expected = expected_host_expert_bytes(llm._moe_blocks, 2)
    assert expected > 0 and row.host_expert_bytes == pytest.approx(expected)
    kv_bytes = row.step_bound_ms / 1e3 * rates.split_gbs() * 1e9  # the step's host KV bytes, back from its KV bound
    assert row.joint_step_bound_ms == pytest.approx((kv_bytes + expected) / (rates.split_gbs() * 1e9) * 1e3)
    assert row.tpot_bound_ms == row.joint_step_bound_ms > row.step_bound_ms
    table = format_table([row])
    assert f"{row.tpot_ms / row.joint_step_bound_ms:.2f}x" in table and "GB of host experts it hits (expected)" in table
