"""The headline of an evaluation: one line per model from its saved decode grid (issue 17's
deliverable, the paper's Figure 9 summarised as its abstract does: a geometric-mean decode speedup
over the best baseline at >= 8K context).

Per model (one ``writescope bench --output-json`` grid each):
- the configurations (batch, context >= ``min_context``) where ``writescope`` ran;
- ``writescope``'s decode tok/s (batch / TPOT) over the best baseline of each configuration and over ``gpu``,
  geometric means with their interval over the repeats (:func:`writescope.bench.report.speedups`);
- which baseline was best most often;
- ``writescope``'s TPOT over the step's bound with both paths at once (:attr:`BenchRow.tpot_bound_ms`:
  KV and, where routed experts live in host memory, the hit host experts; the median over those
  configurations; rows written before the bench measured its bounds have none);
- the configurations where ``writescope`` is slower than that configuration's best baseline by more
  than the noise (every ratio the repeats allow below 1; issue 17: it never should be);
- the baselines the grid lacks (``gpu``, ``cpu``, ``monolithic``, a sweep of at least two fixed
  shares, and on CUDA, where a decode step hits routed experts in host memory, a fixed policy whose
  CPU computes them: ``POLICY@expert_stream_share=0``, since fixed policies read them in place over
  PCIe by default): a grid without all of them cannot show the target met, only not met (a missing
  baseline could only be faster than those present).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from writescope.bench.report import (computes_host_experts_on_cpu, median_run, run_ratio, runs, speedup_spread, speedups,
                                     static_share)
from writescope.bench.runner import BenchRow

TARGET = 1.7  # issue 17's target: writescope over the best baseline, per model


@dataclass
class Headline:
    model: str
    configurations: int
    over_best: float | None
    over_best_spread: tuple[float, float] | None
    over_gpu: float | None
    best_baseline: str
    x_bound: float | None
    source: str = ""  # the grid it comes from (a file name)
    below: list[str] = field(default_factory=list)  # "BxCK: ratio vs baseline [lo-hi]" where writescope loses beyond the noise
    missing: list[str] = field(default_factory=list)  # baselines the grid lacks ("monolithic", "static sweep", ...)
    batches: list[int] = field(default_factory=list)  # the batch sizes of its configurations at >= the context floor


CPU_EXPERTS = "fixed share with CPU experts"  # the missing-baseline name of a fixed policy whose CPU computes the host experts


def missing_baselines(policies, host_experts: bool = False) -> list[str]:
    """The baselines of issue 17's grid absent from ``policies`` (policy names as the bench writes
    them): ``gpu``, ``cpu``, ``monolithic``, "static sweep" (fewer than two fixed shares strictly
    between 0 and 1: ``gpu`` and ``cpu`` are the shares 0 and 1, no sweep), and, where
    ``host_experts`` (a CUDA step that hits routed experts in host memory, which fixed policies read
    in place by default), :data:`CPU_EXPERTS` (no row :func:`computes_host_experts_on_cpu`)."""
    names = set(policies)
    out = [p for p in ("gpu", "cpu", "monolithic") if p not in names]
    if len({r for r in map(static_share, names) if r is not None and 0 < r < 1}) < 2:
        out.append("static sweep")
    if host_experts and not any(map(computes_host_experts_on_cpu, names)):
        out.append(CPU_EXPERTS)
    return out


def target_status(h: "Headline") -> str:
    """``met``, ``not met``, or, for a grid at or above the target that lacks a baseline, ``not shown
    (no ...)``: a baseline not run could only have been faster than those run."""
    if h.over_best is None:
        return "-"
    if h.over_best < TARGET:
        return "not met"
    return "met" if not h.missing else f"not shown (no {', no '.join(h.missing)})"


def _is_baseline(policy: str) -> bool:
    """The baselines :func:`writescope.bench.report.speedups` compares with: gpu, cpu, monolithic,
    static:R, and those fixed policies run with ``@expert_stream_share=0``."""
    return policy in ("gpu", "cpu", "monolithic") or static_share(policy) is not None or computes_host_experts_on_cpu(policy)


def headline(model: str, rows: list[BenchRow], min_context: int = 8192, source: str = "", device: str = "",
             expert_stream_share: float | None = None) -> Headline:
    """The headline of one model's grid ``rows`` (module docstring); ``source`` names the grid;
    ``device`` (the grid's, e.g. ``"cuda"``) and ``expert_stream_share`` (the grid's
    ``--expert-stream-share``, None where not given) say whether a cell whose rows hit host experts
    lacks a fixed policy that computes them on the CPU (not on CPU devices, where they all are, nor
    in a grid run with a share of 0 for every row)."""
    experts_in_place = device.startswith("cuda") and expert_stream_share != 0
    s, spread = speedups(rows, min_context), speedup_spread(rows, min_context)
    best = s.get("best baseline")
    counts: dict[str, int] = {}
    ratios, below, missing = [], [], []  # missing: per cell (a baseline run at 8K only is missing at 32K)
    cells = {(b, c) for (b, c, p) in runs(rows) if c >= min_context}
    for b, c in sorted(cells):
        group = {p: [r for r in rs if r.fits and r.step_tok_s > 0] for (bb, cc, p), rs in runs(rows).items() if (bb, cc) == (b, c)}
        base = {p: median_run(rs).step_tok_s for p, rs in group.items() if rs and _is_baseline(p)}  # the table's run of each
        ws = group.get("writescope") or []
        hosted = experts_in_place and any(r.host_expert_bytes > 0 for rs in group.values() for r in rs)
        missing += [m for m in missing_baselines(group, hosted) if m not in missing]
        if base:
            name = max(base, key=base.get)
            counts[name] = counts.get(name, 0) + 1
            if ws and all(r.step_tok_s > 0 for r in ws):
                x, lo, hi = run_ratio(ws, group[name], "step_tok_s")
                if hi < 1:
                    below.append(f"{b}x{c // 1024}K: {x:.2f}x {name} [{lo:.2f}-{hi:.2f}]")
        if ws and all(r.tpot_bound_ms > 0 for r in ws):
            shown = median_run(ws)
            ratios.append(shown.tpot_ms / shown.tpot_bound_ms)
    return Headline(model, best[1] if best else 0, best[0] if best else None, spread.get("best baseline"),
                    s["gpu"][0] if "gpu" in s else None, max(counts, key=counts.get) if counts else "-",
                    statistics.median(ratios) if ratios else None, source, below, missing, sorted({b for b, _ in cells}))


def format_headline(lines: list[Headline], min_context: int = 8192) -> str:
    """A markdown table of the headlines, with the target."""
    out = [f"| model | grid | configurations (context >= {min_context // 1024}K) | best baseline (most often) | writescope over it "
           f"(geometric mean [over the repeats]) | over `gpu` | writescope TPOT / bound | issue 17's target {TARGET}x |",
           "|---|---|---|---|---|---|---|---|"]
    for h in lines:
        spread = h.over_best_spread
        over = "-" if h.over_best is None else f"**{h.over_best:.2f}x**" + (
            f" [{spread[0]:.2f}-{spread[1]:.2f}]" if spread and spread[0] != spread[1] else "")
        gpu = "-" if h.over_gpu is None else f"{h.over_gpu:.2f}x"
        bound = "-" if h.x_bound is None else f"{h.x_bound:.2f}x"
        met = target_status(h)
        out.append(f"| {h.model} | {h.source or '-'} | {h.configurations} | {h.best_baseline} | {over} | {gpu} | {bound} | {met} |")
    for h in lines:
        if h.below:
            out.append(f"\n{h.model}: writescope is slower than the best baseline beyond the noise in {len(h.below)} of "
                       f"{h.configurations} configurations: " + "; ".join(h.below))
    if any(h.configurations == 0 for h in lines):
        out.append(f"\n(-: no configuration with context >= {min_context} where writescope ran; the tiny presets stop at 8,192 "
                   "positions, so their grids have none)")
    if any(h.x_bound is None and h.configurations for h in lines):
        out.append("(TPOT / bound -: the grid's rows predate the bench's bound measurement)")
    return "\n".join(out)


def _grid_label(model: str, h: Headline) -> str:
    """What tells one of a model's grids from its others under its bar: ``batch 4`` (or ``batch
    4, 16``), else its file name less ``grid_MODEL_``."""
    if h.batches:
        return "batch " + ", ".join(map(str, h.batches))
    return Path(h.source).stem.removeprefix(f"grid_{model}_")


def plot_headline(lines: list[Headline], path: Path) -> None:
    """One bar per model: writescope over the best baseline and over ``gpu``, the target marked.

    Raises:
        ImportError: matplotlib is missing (``pip install matplotlib``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(lines), 3.6))
    xs = range(len(lines))
    ax.bar([x - 0.18 for x in xs], [h.over_best or 0 for h in lines], 0.36, label="over the best baseline")
    ax.bar([x + 0.18 for x in xs], [h.over_gpu or 0 for h in lines], 0.36, label="over gpu")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(TARGET, color="tab:red", ls="--", lw=0.8, label=f"target {TARGET}x")
    models = [h.model for h in lines]  # a model with several grids: each bar named by its batches, else its grid
    ax.set_xticks(list(xs), [m if models.count(m) == 1 else f"{m}\n{_grid_label(m, h)}" for m, h in zip(models, lines)], fontsize=8)
    for x, h in zip(xs, lines):  # a grid short of a baseline: its "over the best baseline" is an upper bound
        if h.missing and h.over_best:
            ax.annotate("no " + ", ".join(h.missing), (x - 0.18, h.over_best), textcoords="offset points", xytext=(0, 3),
                        ha="center", fontsize=7)
    ax.set_ylabel("writescope decode tok/s ratio\n(geometric mean, context >= 8K)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
