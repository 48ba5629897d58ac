"""writescope.bench.timeline: a decode step laid out across the CPU worker, the compute stream and
the link; the native worker's job times; ``writescope profile --timeline`` end to end on the CPU."""

from __future__ import annotations

import json
import time

import pytest
import torch

from writescope.attention import cpu_kernel
from writescope.bench.timeline import DeviceEvent, Job, Timeline, _union, build_steps, flag_offset, format_summary, sync_offset, to_json
from writescope.cli.main import main

MS = 1_000_000  # ns


def _ev(name, stream, a, b):
    return DeviceEvent(name, stream, int(a * MS), int(b * MS))


def _split_step():
    """Two steps of a two-layer split decode, times in ms: on stream 7 the q flag (``_store``), the
    device's own kernels and its wait for the CPU (``_wait``); on stream 9 the link's copies; the
    CPU's jobs. Step 1 (0-20 ms): layer 0's q at 1.0, the CPU sees it at 1.1 and is done at 5.0, the
    device waits 3.0-5.1; layer 1's q at 6.0 (merge and O in between), seen at 6.2, done at 9.0, the
    device waits 8.0-9.05. Copies 0.5-4.0 and 3.5-7.0 overlap (6.5 ms of link busy)."""
    device = [
        _ev("_store", 7, 1.0, 1.01), _ev("gemm", 7, 1.5, 2.5), _ev("_wait", 7, 3.0, 5.1), _ev("merge", 7, 5.2, 5.4),
        _ev("_store", 7, 6.0, 6.01), _ev("_wait", 7, 8.0, 9.05),
        _ev("Memcpy HtoD (Pinned -> Device)", 9, 0.5, 4.0), _ev("Memcpy HtoD (Pinned -> Device)", 9, 3.5, 7.0),
        _ev("Memcpy DtoH (Device -> Pinned)", 7, 0.9, 0.95),  # q to the host: not the link's load
        _ev("gemm", 8, 2.0, 3.0),  # another stream's kernel (say the load partials on their own): counted, overlaps once
        # step 2 (20-40 ms): one job whose q came while the worker was still busy? no: one layer only
        _ev("_store", 7, 21.0, 21.01), _ev("_wait", 7, 22.0, 30.0),
    ]
    jobs = [Job(int(0.2 * MS), int(1.1 * MS), int(5.0 * MS)), Job(int(5.0 * MS), int(6.2 * MS), int(9.0 * MS)),
            Job(int(20.5 * MS), int(21.3 * MS), int(29.9 * MS))]
    issues = [int(0.4 * MS), int(5.5 * MS), int(20.2 * MS)]
    return build_steps([(0, 20 * MS), (20 * MS, 40 * MS)], device, jobs, issues)


def test_a_split_step_is_taken_apart_job_by_job():
    s1, s2 = _split_step()
    assert (len(s1.jobs), len(s1.stores), len(s1.waits), len(s1.copies)) == (2, 2, 2, 2)
    assert [(e.name, e.stream) for e in s1.kernels] == [("gemm", 7), ("gemm", 8), ("merge", 7)]  # flag kernels and copies apart
    rows = s1.per_job()
    assert rows[0]["cpu_ms"] == pytest.approx(3.9) and rows[1]["cpu_ms"] == pytest.approx(2.8)
    assert rows[0]["q_to_cpu_ms"] == pytest.approx(0.09)  # store ends at 1.01, seen at 1.1
    assert rows[0]["gpu_wait_ms"] == pytest.approx(2.1) and rows[0]["done_to_gpu_ms"] == pytest.approx(0.1)
    assert rows[0]["cpu_idle_ms"] == pytest.approx(1.2) and rows[1]["cpu_idle_ms"] is None  # the last job of the step
    assert rows[0]["issue_lead_ms"] == pytest.approx(0.6) and rows[1]["issue_lead_ms"] == pytest.approx(0.5)
    summary = s1.summary()
    assert summary["step_ms"] == 20.0 and summary["cpu_busy_ms"] == pytest.approx(6.7)
    assert summary["link_busy_ms"] == pytest.approx(6.5)  # 0.5-7.0: the overlap counted once
    assert summary["gpu_busy_ms"] == pytest.approx(1.7) and summary["gpu_wait_ms"] == pytest.approx(3.15)  # 1.5-3.0 and 5.2-5.4
    assert s2.summary()["jobs"] == 1 and s2.per_job()[0]["gpu_wait_ms"] == pytest.approx(8.0)
    text = format_summary(Timeline([s1, s2], "flags", 20_000))
    assert "CPU worker busy" in text and "link (host-to-device copies) busy" in text and "main thread ahead" in text
    assert "within 20 us" in text
    doc = to_json(Timeline([s1, s2], "flags", 20_000))
    assert len(doc["steps"]) == 2 and doc["first_step"]["jobs"][0] == pytest.approx([0.2, 1.1, 5.0])


def test_a_worker_busy_with_the_last_job_is_not_slow_to_see_its_q():
    """q_to_cpu counts from the later of the q flag and the previous job's end."""
    device = [_ev("_store", 1, 1.0, 1.0), _ev("_wait", 1, 1.5, 4.0), _ev("_store", 1, 2.0, 2.0), _ev("_wait", 1, 2.5, 7.0)]
    jobs = [Job(0, int(1.0 * MS), int(4.0 * MS)), Job(int(4.0 * MS), int(4.05 * MS), int(7.0 * MS))]
    (st,) = build_steps([(0, 10 * MS)], device, jobs)
    assert st.per_job()[1]["q_to_cpu_ms"] == pytest.approx(0.05)  # not 2.05: the worker was busy until 4.0


def test_unpaired_jobs_leave_the_device_figures_out():
    (st,) = build_steps([(0, 10 * MS)], [_ev("_store", 1, 1.0, 1.0)], [Job(0, MS, 2 * MS), Job(2 * MS, 3 * MS, 4 * MS)])
    rows = st.per_job()
    assert rows[0]["cpu_ms"] == 1.0 and rows[0]["gpu_wait_ms"] is None and rows[0]["q_to_cpu_ms"] is None
    assert st.summary()["median_gpu_wait_ms"] is None
    assert "(no device)" not in format_summary(Timeline([st], "sync", None))  # a device event was seen


def test_union_clips_and_merges():
    evs = [_ev("a", 0, 1, 3), _ev("b", 0, 2, 4), _ev("c", 0, 6, 12), _ev("d", 0, 13, 14)]
    assert _union(evs, 0, 10 * MS) == 7 * MS  # 1-4 and 6-10
    assert _union([], 0, MS) == 0


def test_the_flag_kernels_place_the_device_clock():
    """Device times are host times + 5 ms; the worker saw each q 20 us after its _store ended and
    the device saw each done flag 30 us after it was set: the offset lies between 5 ms - 20 us and
    5 ms + 30 us, and its midpoint is 5 ms + 5 us, within 25 us."""
    off = 5 * MS
    jobs = [Job(0, int(1.0 * MS), int(4.0 * MS)), Job(int(4.0 * MS), int(6.0 * MS), int(8.0 * MS))]
    us = 1000
    device = [DeviceEvent("_store", 1, 980 * us, 980 * us), DeviceEvent("_wait", 1, 2000 * us, 4030 * us),
              DeviceEvent("_store", 1, 5980 * us, 5980 * us), DeviceEvent("_wait", 1, 6500 * us, 8030 * us)]
    device = [DeviceEvent(e.name, e.stream, e.start + off, e.end + off) for e in device]
    got, unc = flag_offset(device, jobs)
    assert got == off + 5_000 and unc == 25_000
    assert flag_offset([e for e in device if e.name == "_wait"], jobs) is None  # no _store: nothing to pair
    got, unc = flag_offset([e for e in device if e.name == "_store"], jobs)  # no wait: the lower bound alone
    assert got == off - 20_000 and unc == 0
    assert sync_offset(device, 8050 * us) == off - 20_000 and sync_offset([], 0) is None


@pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="no C++ compiler for the CPU attention kernel")
def test_the_native_worker_records_its_jobs_times():
    from writescope.attention.cpu_worker import NativeWorker

    gen = torch.Generator().manual_seed(3)
    w = NativeWorker(2, torch.device("cpu"))
    try:
        def job():
            q = torch.randn(2, 1, 16, 64, generator=gen).bfloat16()
            lat = torch.randn(1, 300, 64, generator=gen).bfloat16()
            out = (torch.empty(2, 1, 16, 48), torch.empty(2, 1, 16))
            w.consume(w.submit(q, [(lat, lat[..., :48]), None], 0.1, out))

        job()
        assert w.take_trace() == []  # not recording yet
        w.trace(True)
        t0 = time.perf_counter_ns()
        seqs = []
        for _ in range(3):
            job()
            seqs.append(w.seq)
        t1 = time.perf_counter_ns()
        trace = w.take_trace()
        assert [t[0] for t in trace] == seqs
        for _, taken, seen, done in trace:
            assert t0 <= taken <= seen <= done <= t1  # the worker's clock is perf_counter_ns's
        assert all(a[3] <= b[1] for a, b in zip(trace, trace[1:]))  # one job after another
        w.trace(False)
        job()
        assert w.take_trace() == []
    finally:
        w.close()


@pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="no C++ compiler for the CPU attention kernel")
def test_profile_lays_out_several_policies_in_time(tmp_path, capsys):
    """Two policies on one loaded model, the KV written at random: a timeline PNG each, the CPU
    worker's jobs one per layer of every profiled step, and the runs in the JSON."""
    out, png = tmp_path / "p.json", tmp_path / "tl.png"
    rc = main(["profile", "--model", "tiny-deepseek-v2", "--batch", "2", "--context", "300", "--window", "16",
               "--policy", "static:0.5,static:0.5@WRITESCOPE_MICRO_BATCHES=2", "--steps", "2", "--skip", "1",
               "--kv-fill", "random", "--timeline", str(png), "--output-json", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.count("timeline of 2 decode step(s)") == 2 and "(no device)" in printed and "decode step" in printed
    doc = json.loads(out.read_text())
    assert [r["entry"] for r in doc["runs"]] == ["static:0.5", "static:0.5@WRITESCOPE_MICRO_BATCHES=2"]
    layers = doc["num_layers"]
    jobs = [[s["jobs"] for s in r["timeline"]["steps"]] for r in doc["runs"]]
    assert jobs == [[layers, layers], [2 * layers, 2 * layers]]  # a job per layer, per half with two micro-batches
    for r in doc["runs"]:
        assert all(0 < s["cpu_busy_ms"] < s["step_ms"] for s in r["timeline"]["steps"])
    for name in ("tl_static_0.5.png", "tl_static_0.5_WRITESCOPE_MICRO_BATCHES_2.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_refuses_a_bad_switch_before_loading(capsys):
    assert main(["profile", "--model", "tiny-qwen3-moe", "--policy", "gpu@WRITESCOPE_NOPE=1", "--quiet"]) == 2
    assert "not a per-row switch" in capsys.readouterr().err


@pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="no C++ compiler for the CPU attention kernel")
def test_profile_timeline_alone(tmp_path, capsys):
    """--no-breakdown: only the timeline is run and written; without --timeline it is refused before loading."""
    out, png = tmp_path / "p.json", tmp_path / "tl.png"
    assert main(["profile", "--model", "tiny-qwen3-moe", "--batch", "2", "--context", "200", "--window", "16", "--policy", "static:0.5",
                 "--steps", "2", "--skip", "0", "--no-breakdown", "--timeline", str(png), "--output-json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "other (main)" not in printed and "timeline of 2 decode step(s)" in printed
    doc = json.loads(out.read_text())
    assert "ranges" not in doc and len(doc["timeline"]["steps"]) == 2 and png.exists()
    assert main(["profile", "--model", "tiny-qwen3-moe", "--no-breakdown", "--quiet"]) == 2
    assert "give --timeline" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--policy", "static:0.5,static:0.5", "--timeline", "t.png"], "names a policy twice"),
    (["--policy", "static:0.5,statik:0.5", "--timeline", "t.png"], "unknown policy 'statik:0.5'"),
    (["--policy", "static:0.5", "--timeline", "t.svg"], "give a path ending in .png"),
    (["--policy", "static:0.5", "--host-profile", "h.png"], "--host-profile writes text (pstats' listing): give a path ending in .txt"),
    (["--policy", "static:0.5", "--timeline", "t.png", "--no-breakdown", "--trace", "t.json"], "leave out --no-breakdown, or --trace"),
])
def test_profile_refuses_before_loading(flags, says, tmp_path, monkeypatch, capsys):
    """Every policy name, a duplicate, the timeline's format and a trace that would not be written
    are refused before the model loads (a bad second policy once cost the first one's results)."""
    import writescope.engine.llm as engine

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(engine.LLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["profile", "--model", "tiny-qwen3-moe", "--quiet", *flags]) == 2
    assert says in capsys.readouterr().err


def test_the_expert_workers_jobs_pair_with_their_flags_in_stream_order():
    """A layer: the attention job's flags, then the experts' job's flags, on one compute stream
    (times in ms). The attention job sees q at 1.1 and is done at 3.0; the experts' job sees its
    inputs at 4.2 and is done at 6.0."""
    device = [_ev("_store", 7, 1.0, 1.01), _ev("_wait", 7, 2.0, 3.05), _ev("_store", 7, 4.0, 4.01), _ev("_wait", 7, 5.0, 6.1),
              _ev("gemm", 7, 4.1, 4.9)]
    jobs = [Job(int(0.5 * MS), int(4.2 * MS), int(6.0 * MS), "experts"), Job(int(0.2 * MS), int(1.1 * MS), int(3.0 * MS))]
    (step,) = build_steps([(0, 20 * MS)], device, jobs, [int(0.4 * MS)])
    rows = step.per_job()
    assert [r["kind"] for r in rows] == ["attention", "experts"]
    assert rows[1]["q_to_cpu_ms"] == pytest.approx(0.19) and rows[1]["gpu_wait_ms"] == pytest.approx(1.1)
    assert rows[0]["issue_lead_ms"] == pytest.approx(0.6) and rows[1]["issue_lead_ms"] is None  # issues are attention calls
    summary = step.summary()
    assert summary["cpu_attention_ms"] == pytest.approx(1.9) and summary["cpu_experts_ms"] == pytest.approx(1.8)
    assert summary["median_cpu_ms"] == pytest.approx(1.9) and summary["median_expert_ms"] == pytest.approx(1.8)
    text = format_summary(Timeline([step], "flags", 1_000))
    assert "host experts 1.80 (1 expert jobs" in text


def test_the_timeline_records_the_expert_workers_jobs(tmp_path, monkeypatch):
    from writescope import LLM
    from writescope.bench.timeline import decode_timeline, plot
    from writescope.moe import async_experts
    from writescope.moe.block import SparseMoeBlock
    from writescope.moe.cpu_experts import kernel_available

    if not kernel_available() or not cpu_kernel.kernel_available():
        pytest.skip("the native kernels do not build here")
    monkeypatch.setenv(async_experts.ENV, "on")
    llm = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16", policy="static:0.5", window=16)
    for b in (m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)):
        b.offload_experts(range(0, b.cfg.num_experts, 2))
    tl = decode_timeline(llm, [list(range(3, 60)), list(range(5, 50))], steps=2, skip=1)
    kinds = {j.kind for s in tl.steps for j in s.jobs}
    assert "experts" in kinds
    layers = llm.config.num_layers
    assert all(s.summary()["expert_jobs"] == layers for s in tl.steps)  # one per MoE layer and step
    plot(tl.steps[0], str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="no C++ compiler for the CPU attention kernel")
def test_profile_applies_an_entrys_expert_stream_share(tmp_path, capsys):
    """``POLICY@expert_stream_share=S`` is an engine setting, not an environment variable: profile
    sets it for that entry alone, as bench does for a row (run 50 profiled such an entry with the
    run's own share, the experts read in place), and the next entry runs with the run's share."""
    from writescope.budget.plan import make_plan
    from writescope.presets import preset_config
    from writescope.scheduler.policies import StaticPolicy

    # half the routed experts in host memory, planned for what this profile holds (2 x 103 tokens)
    plan = make_plan(preset_config("tiny-qwen3-moe"), torch.float32, 2**40, 2, 103, 0, StaticPolicy(0.5), 16)
    budget = plan.gpu_min + (plan.experts_total // 2 + 8) * plan.expert_bytes
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "tiny-qwen3-moe", "--batch", "2", "--context", "100", "--window", "16",
                 "--vram-budget", str(budget), "--dtype", "float32", "--steps", "1", "--skip", "0", "--kv-fill", "random",
                 "--policy", "static:0.5@expert_stream_share=0.5,static:0.5", "--expert-stream-share", "0.25",
                 "--output-json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "policy static:0.5 @ expert_stream_share=0.5" in printed
    runs = json.loads(out.read_text())["runs"]
    assert [r["expert_stream_share"] for r in runs] == [0.5, 0.25]
