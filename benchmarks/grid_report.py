"""Re-read saved ``writescope bench --output-json`` grids: print each one's table, best static share
and geometric-mean speedups, and redraw its plot (to apply a newer report to rows already measured;
nothing is re-run).

Run (repository root):
    PYTHONPATH=. python3 benchmarks/grid_report.py benchmarks/results/grid_deepseek-v2-lite_h200.json --plot
    # the evaluation's headline, one line per model's grid (writescope/bench/headline.py):
    PYTHONPATH=. python3 benchmarks/grid_report.py GRID1.json GRID2.json --headline headline.md --headline-plot headline.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from writescope.bench.headline import format_headline, headline, plot_headline
from writescope.bench.report import format_best, format_speedups, format_table, plot
from writescope.bench.runner import BenchRow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("grids", type=Path, nargs="+", help="JSON files written by `writescope bench --output-json`")
    ap.add_argument("--plot", action="store_true", help="write GRID.png beside each GRID.json")
    ap.add_argument("--headline", type=Path, help="write the per-model headline table here (markdown)")
    ap.add_argument("--headline-plot", type=Path, help="and its bar plot here (PNG; needs matplotlib)")
    args = ap.parse_args()
    lines = []
    for path in args.grids:
        doc = json.loads(path.read_text())
        rows = [BenchRow.from_dict(r) for r in doc["rows"]]
        lines.append(headline(doc["model"], rows, source=path.name, device=doc.get("device", ""),
                              expert_stream_share=(doc.get("args") or {}).get("expert_stream_share")))
        print(f"== {path} ({doc['model']}, {doc['num_layers']} layers, {doc['device']}; complete: {doc.get('complete')})")
        print(format_table(rows))
        for text in (format_best(rows), format_speedups(rows)):
            if text:
                print(text)
        if args.plot:
            plot(rows, path.with_suffix(".png"))
            print(f"wrote {path.with_suffix('.png')}")
    table = format_headline(lines)
    print("\n" + table)
    if args.headline:
        args.headline.write_text(table + "\n")
        print(f"wrote {args.headline}")
    if args.headline_plot:
        plot_headline(lines, args.headline_plot)
        print(f"wrote {args.headline_plot}")


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, KeyError) as e:  # a missing file, or not a bench JSON
        raise SystemExit(f"grid_report.py: error: {type(e).__name__}: {e} (give JSON files written by `writescope bench --output-json`)") from None
