"""Plot the r(L) trace of saved ``writescope generate --output-json`` runs: per decode step the
policy's target CPU share and the share placed (mean over the batch), one panel per run.

Run (repository root):
    PYTHONPATH=. python3 benchmarks/trace_plot.py benchmarks/results/1m_deepseek-v2-lite_h200.json \\
        benchmarks/results/text_deepseek-v2-lite_h200.json --out benchmarks/results/r_trace_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", help="JSON files written by `writescope generate --output-json`")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [(p, json.loads(p.read_text())) for p in args.runs]
    fig, axes = plt.subplots(1, len(docs), figsize=(5.5 * len(docs), 3.8), squeeze=False)
    for ax, (path, doc) in zip(axes[0], docs):
        trace = doc.get("r_trace") or []
        if not trace:
            raise ValueError(f"{path} has no r(L) trace: it was not run with a partitioned policy")
        steps = [t["step"] for t in trace]
        ax.plot(steps, [t["target"] for t in trace], label="target r(L)")
        ax.plot(steps, [t["deployed"] for t in trace], label="placed share")
        reqs = doc.get("requests", [])
        m = reqs[0]["metrics"] if reqs else {}
        ax.set_title(f"{doc['model']}, batch {len(reqs)} x {m.get('prompt_tokens', '?')}, {doc['policy']}", fontsize=9)
        ax.set_xlabel("decode step")
        ax.set_ylabel("CPU share of the KV")
        ax.set_ylim(-0.02, max(0.3, max(t["target"] for t in trace) * 1.2))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"trace_plot.py: error: {type(e).__name__}: {e}") from None
