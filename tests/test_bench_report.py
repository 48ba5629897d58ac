"""``writescope bench``'s report over repeats and its flags: every figure of a row from one run,
and what the CLI refuses before the model loads."""

from __future__ import annotations

import pytest

from writescope.cli.main import main


def _run(policy, tpot_ms, attn_ms, repeat, r=None, parts=None):
    from writescope.bench.runner import BenchRow

    extra = {"repeat": repeat}
    if parts is not None:
        extra["split_parts"] = parts
    return BenchRow(2, 8192, policy, decode_tok_s=1.0, tpot_ms=tpot_ms, attn_ms_per_layer=attn_ms,
                    r_deployed=0.0 if policy == "gpu" else r if r is not None else 0.5, extra=extra)


def _parts(attention):
    return {"attention": attention, "gpu_part": attention / 2, "cpu": attention / 4, "cpu_ns_per_token": 1.0, "cpu_gbs": 1.0}


# two runs each (an even count: the mean of the two middle values mixes runs). In each policy the
# faster run (lower TPOT) is not the one of least attention time.
ROWS = [
    _run("gpu", 10.0, 1.0, 0), _run("static:0.5", 9.0, 1.3, 0, parts=_parts(4.0)), _run("writescope", 8.0, 0.8, 0, r=0.4),
    _run("gpu", 12.0, 1.4, 1), _run("static:0.5", 11.0, 0.9, 1, parts=_parts(2.0)), _run("writescope", 10.0, 0.5, 1, r=0.6),
]


def test_a_row_of_an_even_count_of_repeats_shows_one_run_in_every_column():
    """--repeats 2: the table's row is the run of higher TPOT (the upper middle one), decode tok/s
    is its batch / TPOT and attention ms its own, the spread over both runs; the best-static line,
    the ratios and the split parts give the figures of those same runs."""
    from writescope.bench.report import format_best, format_split_parts, format_table

    table = format_table(ROWS)
    lines = {line.split()[2]: line for line in table.splitlines()[1:4]}
    # gpu: the 12 ms run: 2 / 12 ms = 166.7 tok/s (the other run 200: ±10%), its 1.4 ms attention (the other 1.0: ±14%)
    assert "166.7 ±10%" in lines["gpu"] and " 12.00 " in lines["gpu"] and "1.400 ±14%" in lines["gpu"]
    assert "181.8 ±11%" in lines["static:0.5"] and " 11.00 " in lines["static:0.5"] and "0.900 ±22%" in lines["static:0.5"]
    assert "200.0 ±12%" in lines["writescope"] and "0.500 ±30%" in lines["writescope"] and " 0.600 " in lines["writescope"]
    assert "median TPOT" in table and "upper middle" in table  # the rule, where the notes explain the columns
    best = format_best(ROWS)
    # static:0.5's row is its 11 ms run with 0.9 ms attention, the best static one, as the table says
    assert "batch 2 context 8192: best static:0.5 (0.90 ms); writescope r = 0.600, 0.50 ms" in best
    assert "attention 2.80x [1.25-2.80], decode 1.20x [1.00-1.50, within the noise] over gpu" in best
    assert "attention 2.00," in format_split_parts(ROWS)  # the 11 ms run's parts, not the mean of both runs'


def test_the_speedups_and_the_json_s_take_the_same_run():
    """speedups (the printed line and the JSON's speedups_geomean_8k) divide the decode tok/s of
    the runs the table shows."""
    from writescope.bench.report import format_speedups, speedup_spread, speedups

    s = speedups(ROWS)
    assert s["gpu"] == (pytest.approx(200 / 166.6667), 1)
    assert s["best static"] == (pytest.approx(200 / 181.8182), 1)  # static:0.5's 11 ms run beats gpu's 12 ms one
    assert speedup_spread(ROWS)["gpu"] == pytest.approx((200 / 200, 250 / (2e3 / 12)))
    assert "gpu 1.20x (1) [1.00-1.50, within the noise]" in format_speedups(ROWS)


def test_the_plot_draws_the_runs_the_table_shows(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from writescope.bench.report import plot

    calls = []
    real = matplotlib.axes.Axes.plot

    def spy(self, xs, ys, *a, label=None, **k):
        calls.append((label, list(ys)))
        return real(self, xs, ys, *a, label=label, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    plot(ROWS, tmp_path / "p.png")
    gpu = [ys for label, ys in calls if label == "gpu"]  # the decode tok/s panel, then the attention one
    assert gpu == [[pytest.approx(166.6667)], [pytest.approx(1.4)]]
    assert ("best static, batch 2", [0.5]) in calls and ("writescope r, batch 2", [pytest.approx(0.6)]) in calls


@pytest.fixture
def no_model(monkeypatch):
    import writescope.engine.llm as engine

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(engine, "LLM", loaded)


@pytest.mark.parametrize("value", ["", ",", " , "])
def test_an_empty_policy_list_is_refused_before_the_model_loads(no_model, capsys, value):
    assert main(["bench", "--model", "tiny-qwen3-moe", "--policies", value, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--policies {value!r} names no policy" in err and "gpu,cpu,static:0.5,monolithic,writescope" in err


@pytest.mark.parametrize("value", ["1.5", "2k", "0", "4,x", "-1", "1_0"])
def test_batch_takes_plain_sequence_counts(no_model, capsys, value):
    assert main(["bench", "--model", "tiny-qwen3-moe", "--batch", value, "--quiet"]) == 2
    assert f"--batch {value!r}: a comma-separated list of sequence counts, each >= 1, e.g. 4,16" in capsys.readouterr().err


def test_parse_counts_and_context_still_takes_token_counts():
    from writescope.cli.bench import parse_counts, parse_tokens

    assert parse_counts("4, 16,1", "--batch") == [4, 16, 1]
    with pytest.raises(ValueError, match="sequence counts"):
        parse_counts("2k", "--batch")
    assert parse_tokens("2k,300", "--context") == [2048, 300]


def test_help_shows_the_default_policies(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at spaces
    assert ("e.g. static:0.5@WRITESCOPE_MICRO_BATCHES=2, or with its own expert split, writescope@expert_stream_share=0 "
            "(default gpu,cpu,static:0.5,monolithic,writescope)") in text


def test_a_run_that_beats_its_bound_is_said_to():
    """Run 65: the probe's CPU read (53-70 GB/s beside the link) was below what the attention
    kernel read in the step (72-78), and the table showed x bound 0.87 and % bound 130 with no
    word. A row above its bound gets one note naming the worst row; rows within it get none."""
    from writescope.bench.report import above_bound_note, format_table
    from writescope.bench.runner import BenchRow

    within = BenchRow(16, 32768, "gpu", decode_tok_s=1.0, tpot_ms=600.0, attn_ms_per_layer=10.0, bound_ms=8.0,
                      frac_of_bound=0.8, step_bound_ms=400.0)
    assert above_bound_note([within]) == ""
    assert "beat this run's bound" not in format_table([within])
    fast = BenchRow(16, 32768, "writescope", decode_tok_s=1.0, tpot_ms=300.0, attn_ms_per_layer=6.0, bound_ms=7.8,
                    frac_of_bound=1.3, step_bound_ms=400.0)
    note = above_bound_note([within, fast])
    assert note.startswith("note: 1 of 2 runs beat this run's bound") and "writescope: % bound 130, x bound 0.75" in note
    assert note in format_table([within, fast])
    no_step = BenchRow(2, 64, "cpu", decode_tok_s=1.0, tpot_ms=5.0, attn_ms_per_layer=1.0, bound_ms=1.2, frac_of_bound=1.2)
    assert "cpu: % bound 120): " in above_bound_note([no_step])  # no step bound: no x bound named
    unfit = BenchRow(2, 64, "cpu", fits=False, frac_of_bound=2.0)
    assert above_bound_note([unfit]) == ""
    # under the joint bound only (its attention within the KV bound): said, with both causes
    joint = BenchRow(16, 32768, "writescope", decode_tok_s=1.0, tpot_ms=600.0, attn_ms_per_layer=9.0, bound_ms=8.0,
                     frac_of_bound=8 / 9, step_bound_ms=500.0, joint_step_bound_ms=700.0)
    note = above_bound_note([within, joint])
    assert "writescope: % bound 89, x bound 0.86)" in note and "uniform routing" in note
    # experts only (no host KV): no % bound is named
    experts = BenchRow(4, 8192, "gpu", decode_tok_s=1.0, tpot_ms=90.0, joint_step_bound_ms=100.0)
    assert "gpu: x bound 0.90)" in above_bound_note([experts])
    # the worst run is the one furthest over either bound: here the TPOT one
    slightly = BenchRow(2, 64, "cpu", decode_tok_s=1.0, tpot_ms=5.0, attn_ms_per_layer=1.0, bound_ms=1.1, frac_of_bound=1.1)
    assert "e.g. batch 16 context 32768 writescope: % bound 89" in above_bound_note([slightly, joint])  # 1.17 over 1.10
    assert "e.g. batch 2 context 64 cpu: % bound 120" in above_bound_note([no_step, joint])  # 1.20 over 1.17
