"""benchmarks/link_read.py without a GPU: its arguments, rates and table, and a clear refusal."""

import importlib.util
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).parents[1] / "benchmarks"))  # as when run: its folder's modules (interference), last
_spec = importlib.util.spec_from_file_location("link_read", Path(__file__).parents[1] / "benchmarks" / "link_read.py")
link_read = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(link_read)
import interference  # noqa: E402 (benchmarks/, on the path above)


def test_rates_are_bytes_over_each_time():
    assert link_read.rate_line(2_000_000_000, [0.1, 0.05, 0.2]) == (pytest.approx(20.0), pytest.approx(10.0), pytest.approx(40.0))
    for bad in ([], [0.0], [0.1, float("nan")], [-1.0]):
        with pytest.raises(ValueError, match="need >= 1 positive time"):
            link_read.rate_line(1000, bad)
    with pytest.raises(ValueError, match="need >= 1 positive time and >= 1 byte"):
        link_read.rate_line(0, [0.1])


@pytest.mark.parametrize("argv, message", [
    (["--loads", "cpu,disk"], "--loads disk: use some of idle,cpu,copy,cpu\\+copy"),
    (["--loads", ","], "--loads \\(none\\)"),
    (["--experts", "0"], "--experts must be >= 1, got 0"),
    (["--copy-mib", "0"], "--copy-mib must be >= 1, got 0"),
    (["--repeats", "-2"], "--repeats must be >= 1, got -2"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        link_read.parse(argv + ["--out", "/tmp/x"])
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)


def test_without_cuda_it_says_what_it_needs(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        link_read.main(["--out", str(tmp_path / "r")])
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_background_loop_counts_its_calls_and_reports_its_failure():
    n, called = [], threading.Event()

    def call():
        n.append(1)
        called.set()

    with interference.Loop(call, nbytes=10) as lp:
        assert called.wait(60)  # however loaded the machine, the block ends only after a call
    assert lp.calls == len(n) >= 1 and lp.gbs > 0
    started = threading.Event()

    def fails():
        started.set()
        raise OSError("disk gone")

    with pytest.raises(RuntimeError, match="the background load failed: disk gone"):
        with interference.Loop(fails, nbytes=10):
            started.wait(5)


def test_the_table_names_each_load():
    row = {"model": "qwen3-30b-a3b", "experts": 8, "weight_bytes": 8 * 9_437_184, "load": "cpu+copy", "read_gbs": 21.5,
           "read_min_gbs": 19.0, "read_max_gbs": 24.0, "link_alone_gbs": 55.0, "ratio": 21.5 / 55.0, "cpu_kernel_gbs": 80.2,
           "cpu_kernel_alone_gbs": 95.0, "copy_gbs": 30.1}
    idle = dict(row, load="idle", cpu_kernel_gbs=None, copy_gbs=None)
    text = link_read.table([idle, row])
    assert "| qwen3-30b-a3b | 8 x 9.4 | cpu+copy | 21.5 [19.0-24.0] | 55.0 | 0.39 | 80.2 (95.0) | 30.1 |" in text
    assert "| idle | " in text and "| - (95.0) | - |" in text
