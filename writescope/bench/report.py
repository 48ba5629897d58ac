"""Table, best-static summary and plots of bench rows (see :mod:`writescope.bench.runner`)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from writescope.bench.runner import BenchRow
from writescope.scheduler.policies import StaticPolicy, parse_policy


def format_table(rows: list[BenchRow]) -> str:
    head = ("batch", "context", "policy", "prefill tok/s", "decode tok/s", "TPOT ms", "attn ms/layer", "prep ms/layer", "r", "GB/s", "% bound")
    lines = [head]
    for r in rows:
        if not r.fits:
            lines.append((str(r.batch), str(r.context), r.policy, f"does not fit: {r.reason}") + ("",) * (len(head) - 4))
            continue
        lines.append((
            str(r.batch), str(r.context), r.policy, f"{r.prefill_tok_s:,.0f}", f"{r.decode_tok_s:,.1f}", f"{r.tpot_ms:.2f}",
            f"{r.attn_ms_per_layer:.3f}", f"{r.prepare_ms_per_layer:.3f}" if r.prepare_ms_per_layer else "-",
            "-" if r.r_deployed is None else f"{r.r_deployed:.3f}", f"{r.gbs:.1f}",
            f"{100 * r.frac_of_bound:.1f}" if r.frac_of_bound else "-",
        ))
    widths = [max(len(x[i]) for x in lines if not x[3].startswith("does not fit") or i < 3) for i in range(len(head))]
    out = []
    for x in lines:
        if x[3].startswith("does not fit"):
            out.append("  ".join(v.rjust(w) for v, w in zip(x[:3], widths)) + "  " + x[3])
        else:
            out.append("  ".join(v.rjust(w) for v, w in zip(x, widths)))
    return "\n".join(out)


def static_share(policy: str) -> float | None:
    """The fixed CPU share of a static placement: ``gpu`` -> 0, ``cpu`` -> 1 (the same placements
    as ``static:0`` and ``static:1``), ``static:R`` -> R; None for any other policy (as
    :func:`~writescope.scheduler.policies.parse_policy` reads them)."""
    try:
        parsed = parse_policy(policy)
    except ValueError:  # writescope / monolithic without a roofline, or not a policy
        return None
    return parsed.share if isinstance(parsed, StaticPolicy) else None


def best_static(rows: list[BenchRow]) -> dict[tuple[int, int], BenchRow]:
    """Per (batch, context): the static row (``gpu``, ``cpu`` or ``static:R``) with the least
    decode attention time per layer (the time the share changes; decode tok/s also holds the
    expert and Python costs of the step, which on the H200 varied by +-15% between runs of the
    same policy)."""
    best: dict[tuple[int, int], BenchRow] = {}
    for r in rows:
        if r.fits and static_share(r.policy) is not None and r.attn_ms_per_layer > 0:
            k = (r.batch, r.context)
            if k not in best or r.attn_ms_per_layer < best[k].attn_ms_per_layer:
                best[k] = r
    return best


def format_best(rows: list[BenchRow]) -> str:
    best = best_static(rows)
    if not best:
        return ""
    ws = {(r.batch, r.context): r for r in rows if r.fits and r.policy == "writescope"}
    gpu = {(r.batch, r.context): r for r in sorted(rows, key=lambda r: r.policy == "gpu") if r.fits and r.policy in ("gpu", "static:0")}
    lines = ["best static share (least attention ms/layer) vs deployed writescope r; speedups over gpu (attention, decode tok/s):"]
    for (b, c), r in sorted(best.items()):
        w, g = ws.get((b, c)), gpu.get((b, c))
        dep = f"writescope r = {w.r_deployed:.3f}, {w.attn_ms_per_layer:.2f} ms" if w and w.r_deployed is not None else "no writescope row"
        if w and g and w.attn_ms_per_layer > 0 and g.decode_tok_s > 0:
            dep += f" ({g.attn_ms_per_layer / w.attn_ms_per_layer:.2f}x, {w.decode_tok_s / g.decode_tok_s:.2f}x gpu)"
        lines.append(f"  batch {b} context {c}: best {r.policy} ({r.attn_ms_per_layer:.2f} ms); {dep}")
    return "\n".join(lines)


BASELINES = ("gpu", "cpu", "monolithic", "best static", "best baseline")


def speedups(rows: list[BenchRow], min_context: int = 8192) -> dict[str, tuple[float, int]]:
    """Geometric mean over the (batch, context >= ``min_context``) configurations of ``writescope``'s
    decode tok/s divided by each baseline's: ``gpu``, ``cpu``, ``monolithic``, ``best static``
    (per configuration the static share, ``gpu`` and ``cpu`` included, with the most decode
    tok/s) and ``best baseline`` (the most decode tok/s of all of those). The paper's Figure 9
    compares decode throughput this way. Rows repeated for one (batch, context, policy) count as
    their median. Returns ``{baseline: (geometric mean, configurations it covers)}`` for baselines
    measured beside at least one writescope row, and ``{"writescope did not fit": (0, n)}`` when
    writescope failed in n configurations where some baseline ran (those are left out of the means)."""
    tok: dict[tuple[int, int], dict[str, list[float]]] = {}
    failed: set[tuple[int, int]] = set()
    for r in rows:
        if r.context < min_context:
            continue
        if r.fits and r.decode_tok_s > 0:
            tok.setdefault((r.batch, r.context), {}).setdefault(r.policy, []).append(r.decode_tok_s)
        elif r.policy == "writescope":
            failed.add((r.batch, r.context))
    ratios: dict[str, list[float]] = {}
    missed = 0
    for key, by_policy in tok.items():
        med = {p: statistics.median(v) for p, v in by_policy.items()}
        base = {p: v for p, v in med.items() if p in ("gpu", "cpu", "monolithic")}
        statics = [v for p, v in med.items() if static_share(p) is not None]
        if statics:
            base["best static"] = max(statics)
        if base:
            base["best baseline"] = max(base.values())
        if "writescope" not in med:
            missed += key in failed and bool(base)
            continue
        for name, v in base.items():
            ratios.setdefault(name, []).append(med["writescope"] / v)
    out = {n: (math.exp(sum(map(math.log, ratios[n])) / len(ratios[n])), len(ratios[n])) for n in BASELINES if n in ratios}
    if missed:
        out["writescope did not fit"] = (0.0, missed)
    return out


def format_speedups(rows: list[BenchRow], min_context: int = 8192) -> str:
    s = speedups(rows, min_context)
    if not s:
        return ""
    miss = s.pop("writescope did not fit", None)
    text = (f"writescope decode tok/s over each baseline, geometric mean over the configurations with context >= {min_context} "
            "(how many): " + ", ".join(f"{name} {g:.2f}x ({n})" for name, (g, n) in s.items()))
    if miss:
        text += f"; writescope did not fit in {miss[1]} configuration(s) where a baseline ran (left out)"
    return text


def plot(rows: list[BenchRow], path: Path) -> None:
    """decode tok/s and attention ms per layer vs context per policy (two panels per batch),
    and deployed r vs the best static R.

    Raises:
        ImportError: matplotlib is missing (``pip install matplotlib``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r.batch for r in rows})
    fig, axes = plt.subplots(1, 2 * len(batches) + 1, figsize=(5 * (2 * len(batches) + 1), 4), squeeze=False)
    shown = [p for p in dict.fromkeys(r.policy for r in rows) if not p.startswith("static:") or p in _shown_static(rows)]
    for n, b in enumerate(batches):
        for ax, key, label in ((axes[0][2 * n], "decode_tok_s", "decode tok/s"), (axes[0][2 * n + 1], "attn_ms_per_layer", "attention ms per layer")):
            for pol in shown:
                pts = sorted((r.context, getattr(r, key)) for r in rows if r.batch == b and r.policy == pol and r.fits)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"batch {b}: {label}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    ax = axes[0][-1]
    best = best_static(rows)
    for b in batches:
        ctx = sorted(c for (bb, c) in best if bb == b)
        if ctx:
            ax.plot(ctx, [static_share(best[(b, c)].policy) for c in ctx], marker="s", ls="--", label=f"best static, batch {b}")
        dep = sorted((r.context, r.r_deployed) for r in rows if r.batch == b and r.policy == "writescope" and r.fits and r.r_deployed is not None)
        if dep:
            ax.plot([p[0] for p in dep], [p[1] for p in dep], marker="o", label=f"writescope r, batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("CPU share")
    ax.set_title("deployed r(L) vs measured best static share")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shown_static(rows: list[BenchRow]) -> set[str]:
    """Static policies named by the user (not every sweep point) plus the best ones."""
    sweep = {r.policy for r in rows if r.extra.get("sweep")}
    return {r.policy for r in rows if r.policy.startswith("static:") and r.policy not in sweep} | {
        r.policy for r in best_static(rows).values()
    }
