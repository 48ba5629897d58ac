"""``writescope bench`` on the CPU: a small grid writes a table, valid JSON and a PNG."""

from __future__ import annotations

import json
import os

import pytest

from writescope.cli.bench import parse_tokens
from writescope.cli.main import main


def test_bench_grid_json_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the writescope policy calibrates here
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main([
        "bench", "--model", "tiny-qwen3-moe", "--batch", "2", "--context", "48,100,10k", "--steps", "2", "--window", "16",
        "--policies", "gpu,cpu,static:0.5,monolithic,monolithic:0.5,writescope", "--sweep-static", "2",
        "--output-json", str(out_json), "--plot", str(out_png), "--quiet", "--repeats", "1",
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "decode tok/s" in printed and "best static share" in printed
    doc = json.loads(out_json.read_text())
    rows = doc["rows"]
    policies = ["gpu", "cpu", "static:0.5", "monolithic", "monolithic:0.5", "writescope", "static:0", "static:1"]
    assert [(r["context"], r["policy"]) for r in rows] == [(c, p) for c in (48, 100, 10240) for p in policies]
    fit = [r for r in rows if r["context"] < 10240]
    assert all(r["fits"] and r["decode_tok_s"] > 0 and r["attn_ms_per_layer"] > 0 for r in fit)
    # 10k tokens exceed the tiny model's 8,192 positions: reported, and the grid went on
    assert all(not r["fits"] and "beyond the limit" in r["reason"] for r in rows if r["context"] == 10240)
    assert "does not fit" in printed
    by = {(r["context"], r["policy"]): r for r in fit}
    assert by[(100, "gpu")]["r_deployed"] == 0.0 and by[(100, "cpu")]["r_deployed"] == 1.0
    assert by[(100, "monolithic:0.5")]["prepare_ms_per_layer"] > 0  # half the blocks re-laid out every step
    assert by[(100, "monolithic:0.5")]["r_deployed"] == 0.5 and by[(100, "writescope")]["r_deployed"] is not None
    assert doc["roofline"]["a"] > 0
    cal = doc["calibration"]  # the stored calibration behind r: its fitted values and measured points
    assert cal["a"] == doc["roofline"]["a"] and cal["c_cpu"] == doc["roofline"]["c_cpu"]
    assert len(cal["points"]["cpu"]) >= 2 and all(t > 0 and sec > 0 for t, sec in cal["points"]["cpu"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_tokens():
    assert parse_tokens("2k,8k,300, 1.5k") == [2048, 8192, 300, 1536]
    with pytest.raises(ValueError, match="not a token count"):
        parse_tokens("2m")
    with pytest.raises(ValueError, match=">= 1"):
        parse_tokens("0")


def test_bench_rejects_bad_policy_before_loading(capsys):
    assert main(["bench", "--model", "tiny-qwen3-moe", "--policies", "gpu,fast"]) == 2
    assert "unknown policy 'fast'" in capsys.readouterr().err


def test_profile_breaks_a_decode_step_down(tmp_path, capsys):
    out = tmp_path / "bd.json"
    rc = main(["profile", "--model", "tiny-qwen3-moe", "--batch", "2", "--context", "300", "--policy", "static:0.5",
               "--window", "16", "--steps", "3", "--skip", "1", "--output-json", str(out), "--quiet"])
    assert rc == 0
    assert "other (main)" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["step_ms"] > 0 and doc["steps"] == 3
    # every part of a split decode step shows up: both attention sides, the merge, experts, KV writes
    for name in ("attn.cpu_part", "attn.window", "attn.load_region", "attn.merge", "moe.router", "moe.device_experts", "kv.append"):
        assert doc["ranges"][name]["cpu_ms"] > 0, name
    main_ms = sum(v["cpu_ms"] for k, v in doc["ranges"].items() if k != "attn.cpu_part")
    # the main thread's ranges (means over the profiled steps) fit in the mean step, whatever the
    # load: they lie inside the steps and do not nest (the median step can be shorter than the mean)
    assert main_ms <= doc["step_mean_ms"] * 1.001 and doc["other_ms"] == pytest.approx(doc["step_mean_ms"] - main_ms, abs=1e-6)


def test_profile_refuses_bad_steps():
    assert main(["profile", "--model", "tiny-qwen3-moe", "--steps", "0", "--quiet"]) == 2


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_random_kv_fill_skips_the_prefill_and_places_like_it(preset, monkeypatch):
    """--kv-fill random: no prompt goes through the model (every forward is a one-token decode
    step), the cache holds every prompt token routed by the policy, and the grid rows report
    decode numbers with prefill tok/s 0; the real prefill is back afterwards."""
    from writescope import LLM
    from writescope.bench.runner import BenchConfig, run_one

    llm = LLM(preset, progress=False)
    real_forward = llm.model.forward
    query_lens = []

    def spy(ids, batch, cache, *a, **kw):
        query_lens.extend(batch.query_lens)
        return real_forward(ids, batch, cache, *a, **kw)

    monkeypatch.setattr(llm.model, "forward", spy)
    cfg = BenchConfig([2], [100], ["static:0.5", "resident"], steps=3, window=16, warmup=False, kv_fill="random")
    rows = {p: run_one(llm, cfg, 2, 100, p) for p in ("static:0.5", "resident")}
    assert query_lens and set(query_lens) == {1}
    for r in rows.values():
        assert r.fits and r.decode_tok_s > 0 and r.prefill_tok_s == 0.0 and r.extra["kv_fill"] == "random"
    assert rows["static:0.5"].r_deployed == pytest.approx(0.5, abs=0.1)
    assert "_prefill" not in llm.__dict__
    query_lens.clear()
    run_one(llm, BenchConfig([1], [40], ["resident"], steps=1, window=16, warmup=False), 1, 40, "resident")
    assert 40 in query_lens


def test_a_long_reason_does_not_widen_the_table():
    from writescope.bench.report import format_table
    from writescope.bench.runner import BenchRow

    table = format_table([BenchRow(1, 1024, "gpu", decode_tok_s=5.0, tpot_ms=2.0), BenchRow(1, 16384, "gpu", fits=False, reason="x" * 150)])
    head, fit_row = table.splitlines()[:2]
    assert len(fit_row) == len(head) < 120


def _row(b, c, policy, tok_s, attn_ms=1.0):
    from writescope.bench.runner import BenchRow

    return BenchRow(b, c, policy, decode_tok_s=tok_s, tpot_ms=b * 1e3 / tok_s if tok_s else 0.0, attn_ms_per_layer=attn_ms)


def test_speedups_are_geometric_means_over_configurations_from_8k():
    from writescope.bench.report import best_static, format_speedups, speedups

    rows = [
        _row(4, 2048, "gpu", 1.0), _row(4, 2048, "writescope", 100.0),  # below 8K: left out
        _row(4, 8192, "gpu", 10.0, 2.0), _row(4, 8192, "cpu", 5.0, 3.0), _row(4, 8192, "static:0.25", 8.0, 2.5),
        _row(4, 8192, "monolithic", 4.0), _row(4, 8192, "writescope", 20.0),
        _row(4, 32768, "gpu", 10.0, 4.0), _row(4, 32768, "cpu", 2.0, 5.0), _row(4, 32768, "static:0.5", 40.0, 3.0),
        _row(4, 32768, "writescope", 10.0),
        _row(16, 8192, "gpu", 3.0),  # no writescope row: left out
    ]
    rows.append(_row(4, 32768, "monolithic", 1.0))
    rows[-1].fits = False  # a configuration that did not fit is no baseline
    s = speedups(rows)
    assert s["gpu"][0] == pytest.approx(((20 / 10) * (10 / 10)) ** 0.5) and s["gpu"][1] == 2
    assert s["cpu"][0] == pytest.approx(((20 / 5) * (10 / 2)) ** 0.5)
    assert s["monolithic"] == (pytest.approx(5.0), 1)
    assert s["best static"][0] == pytest.approx(((20 / 10) * (10 / 40)) ** 0.5)  # gpu counts as static:0
    assert s["best baseline"][0] == pytest.approx(((20 / 10) * (10 / 40)) ** 0.5)
    assert "best baseline 0.71x" in format_speedups(rows)
    assert "at its bound" not in format_speedups(rows)  # no bound measured: no ceiling
    assert speedups(rows, min_context=65536) == {} and format_speedups(rows, min_context=65536) == ""
    best = best_static(rows)  # by attention time; gpu and cpu are the static shares 0 and 1
    assert best[(4, 8192)].policy == "gpu" and best[(4, 32768)].policy == "static:0.5"


def test_speedups_count_each_baseline_combine_repeats_and_report_misses():
    from writescope.bench.report import format_speedups, speedups

    rows = [
        _row(4, 8192, "gpu", 10.0), _row(4, 8192, "gpu", 30.0), _row(4, 8192, "gpu", 20.0),  # repeats: median 20
        _row(4, 8192, "writescope", 40.0), _row(4, 8192, "writescope", 20.0),  # the run of median TPOT (the upper middle one): 20
        _row(4, 16384, "gpu", 10.0), _row(4, 16384, "monolithic", 5.0), _row(4, 16384, "writescope", 10.0),
        _row(4, 32768, "gpu", 10.0), _row(4, 32768, "writescope", 0.0),
    ]
    rows[-1].fits = False  # writescope failed where gpu ran
    s = speedups(rows)
    assert s["gpu"] == (pytest.approx(((20 / 20) * (10 / 10)) ** 0.5), 2)
    assert s["monolithic"] == (pytest.approx(2.0), 1)  # only where it ran
    assert s["best static"][1] == 2 and s["writescope did not fit"] == (0.0, 1)
    text = format_speedups(rows)
    assert "gpu 1.00x (2)" in text and "monolithic 2.00x (1)" in text and "did not fit in 1 configuration" in text


def test_a_context_past_the_model_limit_names_bench_s_flags(capsys):
    assert main(["bench", "--model", "tiny-qwen3-moe", "--batch", "1", "--context", "64,8k", "--policies", "gpu", "--steps", "1", "--quiet",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "use a shorter --context (bench adds --steps + 1 = 2 tokens)" in out and "lower max_tokens" not in out


def test_bench_words_the_too_long_advice_from_the_error_s_fields():
    """Bench's reason is built from the error's numbers: a garbled message changes nothing."""
    from writescope.bench.runner import too_long_reason
    from writescope.engine.prompts import too_long

    def reason(*numbers):
        e = too_long("prompt_token_ids", 0, *numbers)
        e.args, e.message = ("garbled",), "garbled"
        return too_long_reason(e, steps=1)

    head = "prompt_token_ids[0] has 8,192 tokens + max_tokens 2 = 8,194, beyond the limit of 8,192 tokens"
    assert reason(8192, 2, 8192, 8192) == head + " (the model's max_position_embeddings): use a shorter --context (bench adds --steps + 1 = 2 tokens)"
    assert reason(1, 9000, 8192, 8192).endswith(": use fewer --steps (bench decodes --steps + 1 tokens after the context: at most 8,191 fit)")
    assert reason(100, 20, 64, 8192).endswith("(max_model_len): use a shorter --context (bench adds --steps + 1 = 2 tokens), or raise max_model_len")
    assert reason(64, 64, 64, 64).endswith(": use a shorter --context and fewer --steps")


def test_bench_times_layers_without_synchronising(monkeypatch):
    """The grid's per-layer attention time adds no device synchronisation to the decode step
    (issue 15, item 5): a spy on the timing module's synchronise sees no call during the run,
    and every decode layer still gets a time."""
    from writescope import LLM
    from writescope.bench import runner
    from writescope.engine import timing

    llm = LLM("tiny-qwen3-moe", progress=False)
    calls = []
    real = timing.synchronize
    monkeypatch.setattr(timing, "synchronize", lambda device: (calls.append(device), real(device))[1])
    cfg = runner.BenchConfig([2], [40], ["static:0.5"], steps=3, window=16, warmup=False)
    row = runner.run_one(llm, cfg, 2, 40, "static:0.5")
    assert row.fits and row.attn_ms_per_layer > 0
    assert calls == [], f"{len(calls)} synchronisations inside the timed decode"


def test_rows_break_each_split_call_into_its_parts(monkeypatch):
    """A row with a CPU part says where its attention calls went: per call, the whole call, the
    GPU part and the CPU part with its in-step rate, from the decoder's own counts; a row with
    no CPU part has no CPU figures, and the report lists only the split row."""
    monkeypatch.delenv("WRITESCOPE_LOAD_COPIES", raising=False)
    from writescope import LLM
    from writescope.bench import runner
    from writescope.bench.report import format_split_parts

    llm = LLM("tiny-deepseek-v2", progress=False)
    cfg = runner.BenchConfig([2], [200], ["static:0.5", "gpu"], steps=3, window=16, warmup=False, kv_fill="random")
    split = runner.run_one(llm, cfg, 2, 200, "static:0.5")
    st = llm.cache.decoder.stats
    parts = split.extra["split_parts"]
    layers = llm.config.num_layers
    assert parts["calls"] == parts["calls_with_cpu"] == 3 * layers  # every decode step's layers, timed
    assert not llm.cache.decoder.time_gpu and llm.cache.decoder.gpu_timers is None  # off again after the row
    assert st.cpu_parts == 3 * layers and st.cpu_tokens > 0  # every call had compute blocks
    assert parts["cpu"] == pytest.approx(st.cpu_seconds / st.cpu_parts * 1e3)
    assert parts["cpu_ns_per_token"] == pytest.approx(st.cpu_seconds / st.cpu_tokens * 1e9)
    per_token = llm.config.kv_layout.bytes_per_token(llm.dtype.itemsize)
    assert parts["cpu_gbs"] == pytest.approx(st.cpu_tokens * per_token / st.cpu_seconds / 1e9)
    assert 0 < parts["gpu_part"] and 0 < parts["cpu"] < parts["attention"]  # on the CPU the halves run one after the other
    streamed = runner.run_one(llm, cfg, 2, 200, "gpu")
    assert "cpu" not in streamed.extra["split_parts"] and streamed.extra["split_parts"]["gpu_part"] > 0
    assert streamed.extra["split_parts"]["calls_with_cpu"] == 0
    text = format_split_parts([split, streamed])
    assert "static:0.5" in text and " gpu:" not in text and "ns/token" in text
    assert "early_fills" not in parts and "copied early" not in text  # only with early copies (no host experts here: auto copies none)


def test_a_row_with_early_copies_counts_its_fills(monkeypatch):
    from writescope import LLM
    from writescope.bench import runner
    from writescope.bench.report import format_split_parts

    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "early")
    llm = LLM("tiny-deepseek-v2", progress=False)
    cfg = runner.BenchConfig([2], [200], ["static:0.5"], steps=3, window=16, warmup=False, kv_fill="random")
    row = runner.run_one(llm, cfg, 2, 200, "static:0.5")
    parts, st = row.extra["split_parts"], llm.cache.decoder.stats
    assert parts["early_fills"] == st.early_fills == 3 * (llm.config.num_layers - 1) and parts["early_fills_wasted"] == 0
    assert f"fills copied early: {st.early_fills} used, 0 copied again" in format_split_parts([row])
    cpu = runner.run_one(llm, cfg, 2, 200, "cpu")  # no load region: nothing streamed, so nothing to copy early
    assert llm.cache.decoder.copies_early and llm.cache.decoder.stats.streamed_copies == 0
    assert "early_fills" not in cpu.extra["split_parts"] and "copied early" not in format_split_parts([cpu])


def test_the_pinning_line_sums_the_rows():
    from writescope.bench.report import format_pinning
    from writescope.bench.runner import BenchRow

    rows = [BenchRow(4, 1024, p) for p in ("gpu", "writescope", "static:0.5")]
    assert format_pinning(rows) == ""  # nothing page-locked (the CPU)
    rows[0].extra.update(pinned={"register_bytes": 3e9, "register_s": 1.5, "reused_bytes": 0}, release_ms=200.0)
    rows[1].extra.update(pinned={"register_bytes": 1e9, "register_s": 0.5, "reused_bytes": 2e9}, release_ms=100.0)
    rows[2].fits = False
    rows[2].extra.update(pinned={"register_bytes": 9e9, "register_s": 9.0, "reused_bytes": 0})
    assert format_pinning(rows) == ("page-locking host memory over the rows: 4.0 GB registered in 2.0 s (2.00 GB/s), 2.0 GB lent again "
                                    "by the pinned pool; freeing a batch after its last token: median 0.15 s (not in TPOT)")


def test_the_slow_steps_line_names_steps_far_over_the_median():
    from writescope.bench.report import format_slow_steps
    from writescope.bench.runner import BenchRow

    rows = [BenchRow(4, 1024, p) for p in ("gpu", "writescope", "static:0.5", "cpu")]
    assert format_slow_steps(rows) == ""  # no steps recorded
    rows[0].extra["step_ms"] = [10.0, 10.5, 12.5, 9.5]  # 12.5 is not over 1.25 x 10.25
    rows[1].extra["step_ms"] = [60.0, 10.0, 11.0, 10.0, 30.0]
    rows[1].extra["between_ms"] = [45.0, 0.5, 0.5, 0.5, 0.5]
    rows[1].extra["expert_split"] = {"streamed_steps": [12, 0, 0, 0, 2.5]}
    rows[2].extra["step_ms"] = [50.0, 10.0]  # too few steps for a median to mean much
    rows[3].fits = False
    rows[3].extra["step_ms"] = [50.0, 10.0, 10.0]
    assert format_slow_steps(rows) == ("decode steps over 1.25x their row's median (ms on the main thread: the time since the last "
                                       "tokens were sampled, then the step's issue and wait; TPOT follows the mean):\n"
                                       "  batch 4 context 1024 writescope: median 11.0, mean 24.2 over 5 steps; "
                                       "step 1 60.0 (45.0 before its issue) [12 host experts streamed], "
                                       "step 5 30.0 (0.5 before its issue) [2.5 host experts streamed]")
    del rows[1].extra["between_ms"], rows[1].extra["expert_split"]  # rows of an older JSON: the steps alone
    assert format_slow_steps(rows).endswith("median 11.0, mean 24.2 over 5 steps; step 1 60.0, step 5 30.0")


def test_rows_run_under_their_own_switches(monkeypatch):
    """POLICY@NAME=VALUE+...: the row's cache and forwards see its switches (two micro-batches,
    the in-place load read), the environment is restored after it, and the tokens are those of
    the plain policy; bad switches fail before any work, naming the switch."""
    from writescope.bench import switches
    from writescope.bench.runner import BenchConfig, run_one
    from writescope.engine.llm import LLM

    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES", raising=False)
    monkeypatch.delenv("WRITESCOPE_LOAD_READ", raising=False)
    assert switches.split("static:0.5@WRITESCOPE_MICRO_BATCHES=2+WRITESCOPE_LOAD_READ=in-place") == (
        "static:0.5", {"WRITESCOPE_MICRO_BATCHES": "2", "WRITESCOPE_LOAD_READ": "in-place"})
    assert switches.split("gpu") == ("gpu", {})
    with pytest.raises(ValueError, match="WRITESCOPE_CUDA_GRAPHS is not a per-row switch"):
        switches.check("gpu@WRITESCOPE_CUDA_GRAPHS=off")
    with pytest.raises(ValueError, match="WRITESCOPE_MICRO_BATCHS is not a per-row switch; did you mean WRITESCOPE_MICRO_BATCHES"):
        switches.check("gpu@WRITESCOPE_MICRO_BATCHS=2")
    with pytest.raises(ValueError, match="WRITESCOPE_MICRO_BATCHES='3'"):
        switches.check("gpu@WRITESCOPE_MICRO_BATCHES=3")
    with pytest.raises(ValueError, match="is not NAME=VALUE"):
        switches.check("gpu@WRITESCOPE_MICRO_BATCHES")
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16)
    cfg = BenchConfig([2], [64], ["static:0.5"], steps=3, window=16, warmup=False)
    seen = {}
    real = llm.generate

    def spy(*a, **k):
        seen["mb"], seen["in_place"] = llm.cache.micro_batches, llm.cache.decoder.in_place
        return real(*a, **k)

    monkeypatch.setattr(llm, "generate", spy)
    row = run_one(llm, cfg, 2, 64, "static:0.5@WRITESCOPE_MICRO_BATCHES=2+WRITESCOPE_LOAD_READ=in-place")
    assert row.fits and seen == {"mb": 2, "in_place": True}
    assert row.extra["issue_ms"] > 0 and row.extra["wait_ms"] >= 0  # the main thread's issue and wait per step, in the JSON
    # and each step, in order: the time before its issue since the last tokens were sampled, then that with its issue + wait
    n = len(llm.decode_host)
    assert n > 0 and len(row.extra["step_ms"]) == len(row.extra["between_ms"]) == len(llm.decode_between) == n
    assert all(s >= b + 1e3 * i - 0.01 and s > 0 and b >= 0 for s, b, (i, _) in zip(row.extra["step_ms"], row.extra["between_ms"], llm.decode_host))
    assert row.extra["switches"] == {"WRITESCOPE_MICRO_BATCHES": "2", "WRITESCOPE_LOAD_READ": "in-place"}
    assert "WRITESCOPE_MICRO_BATCHES" not in os.environ and "WRITESCOPE_LOAD_READ" not in os.environ
    plain = run_one(llm, cfg, 2, 64, "static:0.5")
    assert plain.fits and seen == {"mb": 1, "in_place": False}


def test_a_row_runs_its_own_cpu_kernel_tuning(monkeypatch):
    """WRITESCOPE_CPU_TUNING per row (the dynamic split against the equal one in one process):
    the kernel runs the row's tuning during its decode and the default again in the next row."""
    from writescope.attention import cpu_kernel
    from writescope.bench.runner import BenchConfig, run_one
    from writescope.engine.llm import LLM

    if not cpu_kernel.kernel_available():
        pytest.skip("no C++ compiler")
    monkeypatch.delenv("WRITESCOPE_CPU_TUNING", raising=False)
    ext = cpu_kernel._extension()
    default = ext.tuning()
    llm = LLM("tiny-deepseek-v2", progress=False, policy="static:0.5", window=16)
    cfg = BenchConfig([2], [64], ["static:0.5"], steps=2, window=16, warmup=False)
    seen = []
    real = llm.generate

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(ext.tuning())
        return out

    monkeypatch.setattr(llm, "generate", spy)
    tuned = run_one(llm, cfg, 2, 64, f"static:0.5@WRITESCOPE_CPU_TUNING={default | cpu_kernel.DYNAMIC_SPLIT}")
    plain = run_one(llm, cfg, 2, 64, "static:0.5")
    assert tuned.fits and plain.fits and seen == [default | cpu_kernel.DYNAMIC_SPLIT, default]
    assert llm.cache.decoder.stats.cpu_parts > 0  # the rows had CPU parts


def test_the_warm_up_runs_every_batch_size_and_policy_unmeasured(monkeypatch):
    """CUDA graphs are captured per decode token count, so the grid warms up at each of its batch
    sizes (short context, two steps, the grid's KV fill) for each policy, before the first
    measured row; the measured rows are exactly the grid's."""
    from writescope.bench import runner

    calls = []

    def fake(llm, cfg, b, c, p, roofline=None):
        calls.append((b, c, p, cfg.steps, cfg.kv_fill, cfg.warmup))
        return runner.BenchRow(batch=b, context=c, policy=p)

    monkeypatch.setattr(runner, "run_one", fake)
    cfg = runner.BenchConfig([4, 16, 4], [1000, 3000], ["gpu", "static:0.5"], steps=5, window=16, progress=False, kv_fill="random")
    rows = runner.run_grid(None, cfg)
    warm = [(b, c, p) for b, c, p, steps, fill, w in calls if steps == 2]
    assert warm == [(4, 32, "gpu"), (4, 32, "static:0.5"), (16, 32, "gpu"), (16, 32, "static:0.5")]
    assert all(fill == "random" and not w for *_, fill, w in calls[:4])
    assert calls[4:] and all(steps == 5 for _, _, _, steps, _, _ in calls[4:])
    assert [(r.batch, r.context, r.policy) for r in rows] == [(b, c, p) for b in (4, 16, 4) for c in (1000, 3000) for p in ("gpu", "static:0.5")]


def test_the_policies_take_their_turns_in_a_rotated_order_each_repeat(monkeypatch):
    """A cell's repeats rotate the policies' order by one place a repeat (no policy always runs
    right after the same one, nor always first); the rows keep their repeat, and a resumed grid
    still keeps a complete cell whatever its order."""
    from writescope.bench import runner

    assert runner.policy_turn(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert runner.policy_turn(["a", "b", "c"], 1) == ["b", "c", "a"] and runner.policy_turn(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert runner.policy_turn([], 3) == []
    monkeypatch.setattr(runner, "run_one", lambda llm, cfg, b, c, p, roofline=None: runner.BenchRow(batch=b, context=c, policy=p))
    cfg = runner.BenchConfig([4], [1000, 3000], ["gpu", "cpu", "writescope"], steps=5, repeats=3, window=16, progress=False, warmup=False)
    rows = runner.run_grid(None, cfg)
    order = [(r.context, r.extra["repeat"], r.policy) for r in rows]
    assert order == [(c, rep, p) for c in (1000, 3000) for rep in range(3) for p in runner.policy_turn(cfg.policies, rep)]
    assert [p for c, rep, p in order[:9]] == ["gpu", "cpu", "writescope", "cpu", "writescope", "gpu", "writescope", "gpu", "cpu"]
    assert len(runner.complete_cells(cfg, rows)) == len(rows)


def test_resume_keeps_complete_cells_and_measures_the_rest(tmp_path, capsys, monkeypatch):
    """--resume: the (batch, context) cells whose every policy and repeat are in --output-json are
    kept as they are; a cell cut short is measured again whole (its policies in one run); rows
    measured with other measuring flags are refused before the model loads."""
    import writescope.engine.llm as engine
    from writescope.bench import runner
    from writescope.cli.main import main

    out = tmp_path / "grid.json"
    base = ["bench", "--model", "tiny-qwen3-moe", "--device", "cpu", "--context", "48", "--steps", "2", "--window", "16",
            "--policies", "gpu,static:0.5", "--repeats", "1", "--quiet", "--kv-fill", "random", "--output-json", str(out),
            "--h2d-gbs", "50", "--cpu-gbs", "100"]
    assert main(base + ["--batch", "1,2"]) == 0
    first = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["policy"]) for r in first] == [(1, "gpu"), (1, "static:0.5"), (2, "gpu"), (2, "static:0.5")]
    doc = json.loads(out.read_text())
    doc["rows"] = [r for r in doc["rows"] if not (r["batch"] == 2 and r["policy"] == "static:0.5")]  # cell (2, 48) cut short
    out.write_text(json.dumps(doc))
    measured = []
    real = runner.run_one

    def spy(llm, cfg, b, c, p, roofline=None):
        measured.append((b, c, p))
        return real(llm, cfg, b, c, p, roofline)

    monkeypatch.setattr(runner, "run_one", spy)
    capsys.readouterr()
    assert main(base + ["--batch", "1,2,3", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "--resume: 1 of 3 (batch, context) cell(s) complete" in printed and "(2 rows kept;" in printed
    grid = [(b, p) for b, c, p in measured if c == 48]  # the grid's own runs (the warm-ups run at 2 D = 32 tokens)
    assert grid == [(2, "gpu"), (2, "static:0.5"), (3, "gpu"), (3, "static:0.5")]
    assert {b for b, c, _ in measured if c == 32} == {2, 3}  # no warm-up for a batch size with nothing left to measure
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["policy"]) for r in rows] == [(b, p) for b in (1, 2, 3) for p in ("gpu", "static:0.5")]
    kept = [r for r in rows if r["batch"] == 1]
    assert kept == [r for r in first if r["batch"] == 1]  # untouched
    assert all(r["extra"]["bound_rates_gbs"]["source"] == "given" for r in rows)
    assert main(base + ["--batch", "3", "--resume"]) == 0  # a part of the grid: the other cells' rows stay in the file
    assert "2 of 3" not in capsys.readouterr().out
    again = json.loads(out.read_text())["rows"]
    assert sorted((r["batch"], r["policy"]) for r in again) == sorted((r["batch"], r["policy"]) for r in rows)
    assert [r for r in again if r["batch"] == 3] == [r for r in rows if r["batch"] == 3]  # complete: kept, not measured again

    def no_model(*a, **k):
        raise AssertionError("the model was built before the saved rows were checked")

    monkeypatch.setattr(engine.LLM, "__init__", no_model)
    steps = base.index("--steps")
    other = base[:steps + 1] + ["3"] + base[steps + 2:]
    assert main(other + ["--batch", "1", "--resume"]) != 0
    err = capsys.readouterr().err
    assert "were measured otherwise (--steps 2 there, 3 now)" in err
    assert main(base[:-6] + ["--batch", "1", "--resume", "--h2d-gbs", "50", "--cpu-gbs", "100"]) != 0
    assert "--resume needs --output-json" in capsys.readouterr().err


def test_the_bound_caps_the_speedup_the_report_can_show():
    """The ceiling is the best baseline's TPOT over the bound, geometric mean over the
    configurations with a writescope row, a baseline and a bound; the joint bound where there is one."""
    from writescope.bench.report import bound_ceiling, format_speedups

    rows = [_row(4, 8192, "gpu", 10.0), _row(4, 8192, "static:0.5@expert_stream_share=0", 20.0), _row(4, 8192, "writescope", 25.0),
            _row(4, 32768, "gpu", 4.0), _row(4, 32768, "writescope", 5.0),
            _row(4, 65536, "writescope", 5.0)]  # no baseline: left out
    for r in rows:
        if r.policy == "writescope":
            r.step_bound_ms = 100.0  # the KV bound
    rows[2].joint_step_bound_ms = 125.0  # with host experts the joint bound counts instead
    assert rows[1].tpot_ms == pytest.approx(200.0) and rows[3].tpot_ms == pytest.approx(1000.0)
    ceiling, n = bound_ceiling(rows)
    assert n == 2 and ceiling == pytest.approx(((200.0 / 125.0) * (1000.0 / 100.0)) ** 0.5)
    assert f"at its bound writescope would be {ceiling:.2f}x the best baseline (2)" in format_speedups(rows)
    assert bound_ceiling(rows, min_context=10**6) is None


def test_which_rows_get_a_split_warm_up(monkeypatch):
    """Run 65: a micro-batched row's first measured step captured its half-batch CUDA graphs (500
    ms of a 170 ms step), since the warm-up's `writescope` placed no CPU share and so never split.
    A row whose steps may split (its own switch or the process's, 2 or auto) and whose policy may
    place KV on the CPU gets a second warm-up; one that never splits (one sequence, `gpu`,
    `static:0`, `resident`, 1) gets none, and a bad value is refused by name."""
    from writescope.bench.runner import needs_split_warm_up

    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES", raising=False)
    assert needs_split_warm_up("writescope@WRITESCOPE_MICRO_BATCHES=2+expert_stream_share=0", 16)
    assert needs_split_warm_up("static:0.5@WRITESCOPE_MICRO_BATCHES=auto", 4) and needs_split_warm_up("cpu@WRITESCOPE_MICRO_BATCHES=2", 2)
    assert not needs_split_warm_up("writescope", 16)
    assert not needs_split_warm_up("writescope@WRITESCOPE_MICRO_BATCHES=1", 16)
    assert not needs_split_warm_up("writescope@WRITESCOPE_MICRO_BATCHES=2", 1)  # one sequence never splits
    for never in ("gpu", "static:0", "resident"):  # no CPU part: decode_groups never splits
        assert not needs_split_warm_up(f"{never}@WRITESCOPE_MICRO_BATCHES=2", 16)
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "2")  # the process's switch
    assert needs_split_warm_up("writescope", 4) and needs_split_warm_up("monolithic", 4)
    assert not needs_split_warm_up("writescope@WRITESCOPE_MICRO_BATCHES=1", 4)  # the row's own switch wins
    with pytest.raises(ValueError, match="WRITESCOPE_MICRO_BATCHES"):
        needs_split_warm_up("writescope@WRITESCOPE_MICRO_BATCHES=3", 4)


def test_the_warm_up_runs_micro_batched_rows_again_at_their_longest_context(monkeypatch):
    """The grid's warm-up runs a micro-batched row's own entry a second time, at the grid's longest
    context (two steps, unmeasured), once per batch size; rows that never split, or a grid whose
    longest context is the warm-up's own, get no second run."""
    from writescope.bench import runner

    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES", raising=False)
    calls = []
    monkeypatch.setattr(runner, "run_one", lambda llm, cfg, b, c, p, roofline=None: calls.append((b, c, p, cfg.steps)) or
                        runner.BenchRow(batch=b, context=c, policy=p))
    mb = "writescope@WRITESCOPE_MICRO_BATCHES=2"
    cfg = runner.BenchConfig([1, 4, 4], [1000, 3000], ["gpu", mb, "gpu@WRITESCOPE_MICRO_BATCHES=2"], steps=5, window=16, progress=False)
    runner.run_grid(None, cfg)
    warm = [(b, c, p) for b, c, p, steps in calls if steps == 2]
    assert warm == [(1, 32, "gpu"), (1, 32, mb), (1, 32, "gpu@WRITESCOPE_MICRO_BATCHES=2"),
                    (4, 32, "gpu"), (4, 32, mb), (4, 3000, mb), (4, 32, "gpu@WRITESCOPE_MICRO_BATCHES=2")]
    calls.clear()
    runner.run_grid(None, runner.BenchConfig([4], [20], [mb], steps=5, window=16, progress=False))
    assert [(c, p) for _, c, p, steps in calls if steps == 2] == [(20, mb)]  # the first warm-up ran at the row's context


def test_the_second_warm_up_splits_its_steps(monkeypatch):
    """What the second warm-up is for: at the row's batch and context a micro-batched row's
    decode steps split into two halves (the tiny preset on the CPU, a fixed share)."""
    from writescope import LLM
    from writescope.bench.runner import BenchConfig, needs_split_warm_up, run_one

    monkeypatch.delenv("WRITESCOPE_MICRO_BATCHES", raising=False)
    D = 16
    llm = LLM("tiny-qwen3-moe", progress=False, policy="gpu", window=D)
    entry = "static:0.5@WRITESCOPE_MICRO_BATCHES=2"
    assert needs_split_warm_up(entry, 4)
    groups = []
    real = type(llm.cache).decode_groups

    def spy(cache, batch):
        g = real(cache, batch)
        groups.append(g)
        return g

    monkeypatch.setattr(type(llm.cache), "decode_groups", spy)
    row = run_one(llm, BenchConfig([4], [4 * D], [entry], steps=2, window=D, warmup=False, kv_fill="random"), 4, 4 * D, entry)
    assert row.fits
    split = [g for g in groups if g is not None]
    assert split and all(g == [(0, 2), (2, 4)] for g in split)


def test_the_sweep_names_shares_that_place_the_same_blocks():
    """At 1K tokens and D = 256 a prompt has 4 blocks: static:0.125 rounds to 1 block, as
    static:0.25 does, so the note pairs them (and 0.375/0.5, 0.625/0.75, 0.875/1); at 2K
    (8 blocks) every eighth places its own, and no note is printed."""
    from writescope.cli.bench import sweep_placement_note

    sweep = [f"static:{i / 8:g}" for i in range(9)]
    note = sweep_placement_note(sweep, [1024, 2048], 256)
    assert "at 1,024 tokens (4 blocks of D = 256)" in note and "2,048" not in note
    assert "static:0.125 = 0.25 (r 0.25)" in note and "static:0.875 = 1 (r 1)" in note
    assert "static:0 =" not in note and "= 0 (" not in note  # static:0 places no block, alone
    assert sweep_placement_note(sweep, [2048, 32768], 256) is None
