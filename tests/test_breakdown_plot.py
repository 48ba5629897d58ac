"""benchmarks/breakdown_plot.py: a saved breakdown's ranges summed into the issue's parts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("breakdown_plot", Path(__file__).parents[1] / "benchmarks" / "breakdown_plot.py")
bp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bp)


def _r(cpu=0.0, dev=0.0):
    return {"cpu_ms": cpu, "device_ms": dev}


def test_ranges_are_summed_into_parts_and_other_is_what_the_main_thread_leaves():
    doc = {"step_ms": 100.0, "ranges": {
        "attn.window": _r(1.0, 5.0), "attn.load_region": _r(2.0, 50.0), "attn.cpu_part": _r(30.0),
        "moe.device_experts": _r(3.0, 10.0), "moe.streamed_experts": _r(4.0, 8.0), "moe.host_experts": _r(20.0),
        "moe.tokens_to_host": _r(0.5, 1.5), "kv.evict": _r(0.25)}}
    rows = {name: (cpu, dev) for name, cpu, dev in bp.parts(doc)}
    assert rows["attention, GPU part"] == (3.0, 55.0)
    assert rows["attention, CPU part (worker)"] == (30.0, 0.0)
    assert rows["experts on GPU"] == (7.0, 18.0) and rows["experts on CPU"] == (20.5, 1.5)
    assert rows["KV append / evict / drain"] == (0.25, 0.0) and rows["merge"] == (0.0, 0.0)
    # no other_ms saved (older files): 100 - 30.75 on the main thread, labelled as an upper bound
    assert rows["other, at most (CPU time of\ndevice ranges not recorded)"] == (69.25, 0.0)
    rows = {name: cpu for name, cpu, _ in bp.parts({**doc, "other_ms": 12.0})}
    assert rows["other (main thread)"] == 12.0


def test_a_file_that_is_not_a_breakdown_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a breakdown"):
        bp.parts({"rows": []})
    doc = {"step_ms": 10.0, "ranges": {"attn.merge": _r(0.1, 0.2)}}
    out = tmp_path / "p.png"
    bp.plot([("t", doc)], out)
    assert out.stat().st_size > 1000


def test_a_file_of_several_policies_gives_a_panel_each(tmp_path, monkeypatch, capsys):
    """`writescope profile --policy A,B --output-json` keeps its runs under "runs": one panel each."""
    import json
    import sys

    run = {"step_ms": 10.0, "other_ms": 2.0, "ranges": {"attn.merge": _r(0.1, 0.2)}}
    doc = {"model": "m", "batch": 2, "context": 300,
           "runs": [{**run, "policy": "static:0.5", "entry": "static:0.5"}, {**run, "policy": "static:0.5", "entry": "static:0.5@X=2"}]}
    (tmp_path / "p.json").write_text(json.dumps(doc))
    seen = []
    monkeypatch.setattr(bp, "plot", lambda docs, out: seen.extend(t for t, _ in docs))
    monkeypatch.setattr(sys, "argv", ["breakdown_plot", str(tmp_path / "p.json"), "--out", str(tmp_path / "p.png")])
    bp.main()
    assert seen == ["m, batch 2 x 300, static:0.5", "m, batch 2 x 300, static:0.5@X=2"]
