"""benchmarks/prefill_order.py without a GPU: its refusals, and one tiny run's rows (both orders of
each policy, what each read back and kept) and table. Times are printed, never asserted."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("prefill_order_bench", Path(__file__).parents[1] / "benchmarks" / "prefill_order.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("argv, message", [
    (["--policies", "resident"], "resident reads nothing back"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--context", "2q"], "--context"),
    (["--out", "/no/such/dir/x"], "its directory does not exist"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_tiny_run_reports_both_orders_of_each_policy(tmp_path, capsys):
    out = tmp_path / "po"
    bench.main(["--model", "tiny-deepseek-v2", "--batch", "2", "--context", "600", "--prefill-chunk-tokens", "128",
                "--policies", "gpu,writescope", "--rounds", "1", "--window", "16", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    got = {(r["policy"], r["order"]): r for r in rows}
    assert set(got) == {(p, o) for p in ("gpu", "writescope") for o in ("chunk", "layer")}
    for pol in ("gpu", "writescope"):
        chunk, layer = got[(pol, "chunk")], got[(pol, "layer")]
        assert chunk["readback_gb"] > 0 and chunk["kept_gb"] == 0  # pass after pass: earlier KV read back
        assert layer["readback_gb"] == 0 and layer["kept_gb"] == pytest.approx(chunk["readback_gb"])  # one group: all kept
        assert all(r["tok_s"] > 0 for r in chunk["runs"] + layer["runs"])
    text = out.with_suffix(".md").read_text()
    assert "| `writescope` | layer |" in text and "layer order: `gpu` over `writescope`" in text
