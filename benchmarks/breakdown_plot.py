"""Plot saved decode-step breakdowns (``writescope profile --output-json``): one panel per file,
the issue's parts of a step as bars of CPU time and device span (ms per step), and the step's
median time as a line. Nothing is re-run.

The parts (issue 6): attention's GPU part (D-window, load region), its CPU part (the worker),
the merge, experts on the GPU (router, grouped, shared, streamed), experts on the CPU (with their
tokens' copy to the host), KV append / eviction / drain, and the rest of the main thread.
Device and CPU work overlap, so the bars need not add up to the step.

Run (repository root):
    PYTHONPATH=. python3 benchmarks/breakdown_plot.py benchmarks/results/profile_deepseek-v2-lite_h200.json \\
        benchmarks/results/profile_qwen3-30b-a3b_h200.json --out benchmarks/results/profile_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PARTS = (
    ("attention, GPU part", ("attn.window", "attn.load_region", "attn.monolithic_prepare", "attn.q_to_host")),
    ("attention, CPU part (worker)", ("attn.cpu_part",)),
    ("waiting for the CPU part", ("attn.wait_cpu",)),
    ("merge", ("attn.merge",)),
    ("experts on GPU", ("moe.router", "moe.device_experts", "moe.shared_experts", "moe.streamed_experts")),
    ("experts on CPU", ("moe.host_experts", "moe.tokens_to_host")),
    ("KV append / evict / drain", ("kv.append", "kv.evict", "kv.drain")),
)
WORKER = ("attn.cpu_part",)


def parts(doc: dict) -> list[tuple[str, float, float]]:
    """``(part, CPU ms, device span ms)`` per step for each part of a saved breakdown, and last
    ``other``: the step minus the main thread's ranges (the saved ``other_ms`` where the file has
    it; files without it, written before that was fixed, lost the CPU time of the ranges with
    device work, so their ``other`` is an upper bound and is labelled so).
    Raises ValueError when ``doc`` has no ``ranges`` or ``step_ms``."""
    if not isinstance(doc.get("ranges"), dict) or "step_ms" not in doc:
        raise ValueError("not a breakdown: no 'ranges' or 'step_ms' (give a file written by `writescope profile --output-json`)")
    r = doc["ranges"]
    rows = []
    for name, keys in PARTS:
        cpu = sum(r[k].get("cpu_ms", 0.0) for k in keys if k in r)
        dev = sum(r[k].get("device_ms", 0.0) for k in keys if k in r)
        rows.append((name, cpu, dev))
    main = sum(v.get("cpu_ms", 0.0) for k, v in r.items() if k not in WORKER)
    if "other_ms" in doc:
        rows.append(("other (main thread)", doc["other_ms"], 0.0))
    else:
        rows.append(("other, at most (CPU time of\ndevice ranges not recorded)", max(0.0, doc["step_ms"] - main), 0.0))
    return rows


def plot(docs: list[tuple[str, dict]], out: Path) -> None:
    """One panel per ``(title, breakdown)``; writes the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(docs), figsize=(6.5 * len(docs), 4.8), squeeze=False)
    for ax, (title, doc) in zip(axes[0], docs):
        rows = parts(doc)
        ys = range(len(rows))
        ax.barh([y - 0.2 for y in ys], [c for _, c, _ in rows], 0.4, color="C1", label="CPU ms (main thread; the worker's own)")
        ax.barh([y + 0.2 for y in ys], [d for _, _, d in rows], 0.4, color="C0", label="device span ms")
        ax.axvline(doc["step_ms"], color="k", ls="--", lw=1, label=f"step {doc['step_ms']:.0f} ms (median)")
        ax.set_yticks(list(ys), [n for n, _, _ in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per decode step")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.4, -0.14), ncol=3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", type=Path, nargs="+", help="JSON files written by `writescope profile --output-json` (one panel per "
                    "policy profiled)")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = ap.parse_args()
    docs = []
    for f in args.files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"breakdown_plot: {f}: not a readable JSON file ({e}); give the --output-json of `writescope profile`") from None
        runs = [{**doc, **run} for run in doc["runs"]] if isinstance(doc.get("runs"), list) else [doc]  # several policies: one panel each
        for run in runs:
            try:
                parts(run)
            except ValueError as e:
                raise SystemExit(f"breakdown_plot: {f}: {e}") from None
            docs.append((f"{run.get('model', f.stem)}, batch {run.get('batch')} x {run.get('context')}, {run.get('entry', run.get('policy'))}", run))
    plot(docs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
