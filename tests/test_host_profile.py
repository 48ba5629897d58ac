"""writescope.bench.host_profile: the main thread's Python profiled over decode steps, and
``writescope profile --host-profile`` end to end on the CPU."""

from __future__ import annotations

import json

import pytest

from writescope.attention import cpu_kernel
from writescope.cli.main import main


@pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="no C++ compiler for the CPU attention kernel (no native worker)")
def test_host_profile_counts_the_attention_calls_of_each_step(tmp_path, capsys, monkeypatch):
    """Per step, one decode attention call per layer (two per layer with two micro-batches), and
    the decoder's begin among the functions with as many calls; the native worker's submits timed;
    the listing written."""
    monkeypatch.delenv("WRITESCOPE_CPU_ATTENTION", raising=False)
    monkeypatch.delenv("WRITESCOPE_CPU_WORKER", raising=False)
    out, txt = tmp_path / "p.json", tmp_path / "host.txt"
    rc = main(["profile", "--model", "tiny-deepseek-v2", "--batch", "2", "--context", "300", "--window", "16",
               "--policy", "static:0.5,static:0.5@WRITESCOPE_MICRO_BATCHES=2", "--steps", "2", "--skip", "1",
               "--kv-fill", "random", "--no-breakdown", "--host-profile", str(txt), "--output-json", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.count("main thread under cProfile") == 2
    doc = json.loads(out.read_text())
    layers = doc["num_layers"]
    for run, per_layer in zip(doc["runs"], (1, 2)):
        hp = run["host_profile"]
        assert hp["steps"] == 2 and hp["layer_calls"] == per_layer * layers
        assert hp["step_ms"] > 0 and 0 < hp["thread_cpu_ms"]
        # the native worker's submits, timed on the main thread: means over the steps, inside the mean step
        assert 0 < hp["submit_wall_ms"] <= hp["submit_total_ms"] < hp["step_mean_ms"]
        assert all(f["own_ms"] >= 0 and f["cum_ms"] >= f["own_ms"] - 1e-9 for f in hp["functions"])
    for name in ("host_static_0.5.txt", "host_static_0.5_WRITESCOPE_MICRO_BATCHES_2.txt"):
        text = (tmp_path / name).read_text()
        assert "decode_begin" in text and "tottime" in text


def test_host_profile_refuses_bad_counts():
    from writescope.bench.host_profile import main_thread_profile

    with pytest.raises(ValueError, match="steps must be >= 1"):
        main_thread_profile(None, [[1]], steps=0)
