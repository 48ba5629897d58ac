"""benchmarks/spy_summary.py: py-spy's raw stacks reduced to the decode step's shares."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("spy_summary", Path(__file__).parents[1] / "benchmarks" / "spy_summary.py")
spy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spy)

RAW = """\
<module> (writescope/cli/main.py:9);load (writescope/engine/llm.py:40);read (libc.so.6) 500
<module> (writescope/cli/main.py:9);run (writescope/models/decode_step.py:70);consume (writescope/native/flag_worker.py:129);run (triton/runtime/jit.py:700);cuLaunchKernel (libcuda.so.1) 30
<module> (writescope/cli/main.py:9);run (writescope/models/decode_step.py:88);consume (writescope/native/flag_worker.py:131);check (writescope/native/flag_worker.py:150) 10
<module> (writescope/cli/main.py:9);run (writescope/models/decode_step.py:75);partition (writescope/moe/async_experts.py:130);at::native::argsort (libtorch_cpu.so) 60
bad line
"""


def test_only_stacks_through_the_marker_count_and_lines_merge():
    s = spy.summarize(spy.parse(RAW.splitlines()), r"models/decode_step\.py")
    assert s["total"] == 100  # the load's 500 samples dropped
    assert s["inclusive"]["run (writescope/models/decode_step.py)"] == 100  # three lines, one function
    assert s["inclusive"]["consume (writescope/native/flag_worker.py)"] == 40
    assert s["self"]["cuLaunchKernel (libcuda.so.1)"] == 30
    assert s["self"]["check (writescope/native/flag_worker.py)"] == 10
    assert s["under"]["consume (writescope/native/flag_worker.py) > cuLaunchKernel (libcuda.so.1)"] == 30
    assert s["under"]["check (writescope/native/flag_worker.py) > (itself)"] == 10
    assert s["under"]["partition (writescope/moe/async_experts.py) > at::native::argsort (libtorch_cpu.so)"] == 60


def test_frames_split_into_name_place_and_kind():
    assert spy.split_frame("consume (writescope/native/flag_worker.py:129)") == ("consume", "writescope/native/flag_worker.py", True)
    assert spy.split_frame("cuLaunchKernel (libcuda.so.1)") == ("cuLaunchKernel", "libcuda.so.1", False)
    assert spy.split_frame("0x7f00") == ("0x7f00", "", False)


def test_main_prints_ms_per_step_and_fails_without_matching_stacks(tmp_path, capsys):
    raw = tmp_path / "s.raw"
    raw.write_text(RAW)
    assert spy.main([str(raw), "--step-ms", "200", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "100 samples" in out and "120.00 ms" in out  # argsort: 60% of 200 ms
    assert spy.main([str(raw), "--marker", "no_such_frame"]) == 1
