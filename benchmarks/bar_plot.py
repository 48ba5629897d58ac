"""Grouped bar chart of rows already saved in benchmark JSON files (nothing is re-run).

Each file holds ``{"rows": [...]}`` (``writescope bench --output-json``,
``benchmarks/peer_transformers.py``, ...). Rows from all files are pooled; one group of bars per
value of ``--x``, one bar per value of ``--series``, height ``--y``, labelled with its value.
A key may name a nested value with dots (``teacher_forced.max_abs_logit_diff``); without
``--series`` each group has one bar.

Run (repository root):
    PYTHONPATH=. python3 benchmarks/bar_plot.py benchmarks/results/peer_transformers_8k_h200.json \\
        benchmarks/results/peer_transformers_32k_h200.json --x context --series engine --y decode_tok_s \\
        --ylabel "decode tok/s" --title "DeepSeek-V2-Lite, batch 4, H200, no budget" --out benchmarks/results/peer_transformers_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def value(row: dict, key: str):
    """``row[key]``, where ``a.b`` reads ``row["a"]["b"]``; KeyError when any part is missing."""
    for part in key.split("."):
        if not isinstance(row, dict) or part not in row:
            raise KeyError(key)
        row = row[part]
    return row


def _flat(row: dict, keys: list[str]) -> dict:
    """The row with its dotted keys read out (``value``), for drawing."""
    return {k: value(row, k) for k in keys}


def pooled_rows(paths: list[Path], x: str, series: str | None, y: str) -> list[dict]:
    """Rows of every file that have ``x``, ``series`` (when given) and ``y``, each as
    ``{x: ..., series: ..., y: ...}`` with dotted keys read out (:func:`value`).

    Raises:
        ValueError: a file that is not JSON with a ``rows`` list, or whose ``y`` is not a number
            (names the file); no row of any file has all three keys (names the keys the rows do have).
    """
    rows, seen = [], set()
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable JSON file ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            raise ValueError(f"{path}: no 'rows' list (give a file written by `writescope bench --output-json` or a benchmark script)")
        keys = [k for k in (x, series, y) if k is not None]
        for r in doc["rows"]:
            seen.update(r)
            try:
                row = _flat(r, keys)
            except KeyError:
                continue
            if not isinstance(row[y], (int, float)):
                raise ValueError(f"{path}: --y {y!r} is not a number in its rows (got {row[y]!r}): pick a numeric key")
            rows.append(row)
    if not rows:
        raise ValueError(f"no row has all of {', '.join(map(repr, keys))}; the rows' keys are {sorted(seen)} (a.b reads a nested value)")
    return rows


def _label(v: float) -> str:
    """A bar's label: 3 significant digits below 1, one decimal below 100, else whole numbers."""
    return f"{v:.3g}" if abs(v) < 1 else f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def bar_plot(rows: list[dict], x: str, series: str | None, y: str, out: Path, ylabel: str | None = None, title: str | None = None) -> None:
    """Write the chart to ``out`` (PNG). Bars keep the order in which values first appear;
    ``series`` None: one bar per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if series is None:
        series, rows = "_", [{**r, "_": y} for r in rows]
    xs = list(dict.fromkeys(r[x] for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(xs) * max(1, len(names) / 2), 4))
    for k, name in enumerate(names):
        last = {r[x]: r[y] for r in rows if r[series] == name}  # a repeated (x, series): the last row
        pos = [i + (k - (len(names) - 1) / 2) * width for i, xv in enumerate(xs) if xv in last]
        vals = [last[xv] for xv in xs if xv in last]
        bars = ax.bar(pos, vals, width, color=f"C{k}", label=str(name))
        ax.bar_label(bars, labels=[_label(v) for v in vals], fontsize=7)
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or y)
    if title:
        ax.set_title(title, fontsize=10)
    if len(names) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", type=Path, nargs="+", help="JSON files with a 'rows' list")
    ap.add_argument("--x", required=True, help="row key for the groups (e.g. context, batch)")
    ap.add_argument("--series", help="row key for the bars of a group (e.g. engine, policy); none: one bar per group")
    ap.add_argument("--y", required=True, help="row key for the bar heights (e.g. decode_tok_s)")
    ap.add_argument("--ylabel")
    ap.add_argument("--title")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = ap.parse_args()
    try:
        rows = pooled_rows(args.files, args.x, args.series, args.y)
    except ValueError as e:
        raise SystemExit(f"bar_plot: {e}") from None
    bar_plot(rows, args.x, args.series, args.y, args.out, args.ylabel, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
