"""benchmarks/bar_plot.py: rows pooled from saved JSON files, and the chart drawn from them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bar_plot", Path(__file__).parents[1] / "benchmarks" / "bar_plot.py")
bp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bp)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_rows_are_pooled_across_files_and_rows_without_the_keys_are_left_out(tmp_path):
    a = _write(tmp_path / "a.json", [{"engine": "x", "context": 8192, "decode_tok_s": 20.0},
                                     {"engine": "y", "context": 8192, "error": "out of memory"}])
    b = _write(tmp_path / "b.json", [{"engine": "x", "context": 32768, "decode_tok_s": 12.5}])
    rows = bp.pooled_rows([a, b], "context", "engine", "decode_tok_s")
    assert [(r["context"], r["decode_tok_s"]) for r in rows] == [(8192, 20.0), (32768, 12.5)]
    with pytest.raises(ValueError, match=r"'policy'.*keys are \['context', 'decode_tok_s', 'engine', 'error'\]"):
        bp.pooled_rows([a, b], "context", "policy", "decode_tok_s")
    with pytest.raises(ValueError, match=r"a.json: --y 'engine' is not a number"):
        bp.pooled_rows([a, b], "context", "decode_tok_s", "engine")
    bad = tmp_path / "notes.md"
    bad.write_text("# not JSON")
    with pytest.raises(ValueError, match=r"notes.md: not a readable JSON file"):
        bp.pooled_rows([a, bad], "context", "engine", "decode_tok_s")
    no_rows = tmp_path / "c.json"
    no_rows.write_text("{}")
    with pytest.raises(ValueError, match=r"c.json: no 'rows' list"):
        bp.pooled_rows([no_rows], "context", "engine", "decode_tok_s")


def test_chart_has_one_bar_per_row_in_its_group_with_its_height_and_label(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"p": "gpu", "batch": 1, "v": 3.0}, {"p": "cpu", "batch": 1, "v": 2.0}, {"p": "gpu", "batch": 8, "v": 5.0},
            {"p": "gpu", "batch": 8, "v": 150.0}]  # a repeated (batch, policy): the last row is drawn
    saved = {}
    monkeypatch.setattr(plt, "close", lambda fig: saved.setdefault("fig", fig))  # keep the figure to read it back
    out = tmp_path / "sub" / "chart.png"
    bp.bar_plot(rows, "batch", "p", "v", out, title="t")
    assert out.stat().st_size > 1000
    ax = saved["fig"].axes[0]
    bars = {(round(b.get_x() + b.get_width() / 2, 3), b.get_height(), b.get_facecolor()[:3]) for b in ax.patches}
    gpu, cpu = (matplotlib.colors.to_rgb(c) for c in ("C0", "C1"))
    # two series side by side around each group's tick (width 0.4 each); cpu has no batch-8 row: no bar invented
    assert bars == {(-0.2, 3.0, gpu), (0.8, 150.0, gpu), (0.2, 2.0, cpu)}
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "8"]
    assert ax.get_legend_handles_labels()[1] == ["gpu", "cpu"]
    assert sorted(t.get_text() for t in ax.texts) == ["150", "2.0", "3.0"]


def test_dotted_keys_read_nested_values_and_without_series_each_group_has_one_bar(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = _write(tmp_path / "a.json", [{"policy": "gpu", "tf": {"max": 0.25}}, {"policy": "cpu", "tf": {"max": 0.5}},
                                     {"policy": "x", "tf": None}])  # no nested value: left out
    rows = bp.pooled_rows([a], "policy", None, "tf.max")
    assert rows == [{"policy": "gpu", "tf.max": 0.25}, {"policy": "cpu", "tf.max": 0.5}]
    with pytest.raises(ValueError, match=r"no row has all of 'policy', 'tf.min'"):
        bp.pooled_rows([a], "policy", None, "tf.min")
    saved = {}
    monkeypatch.setattr(plt, "close", lambda fig: saved.setdefault("fig", fig))
    bp.bar_plot(rows, "policy", None, "tf.max", tmp_path / "c.png")
    ax = saved["fig"].axes[0]
    assert sorted((round(b.get_x() + b.get_width() / 2, 3), b.get_height()) for b in ax.patches) == [(0.0, 0.25), (1.0, 0.5)]
    assert ax.get_legend() is None
    assert [t.get_text() for t in ax.texts] == ["0.25", "0.5"]
