"""Table, best-static summary and plots of bench rows (see :mod:`writescope.bench.runner`)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from writescope.bench.runner import BenchRow
from writescope.scheduler.policies import StaticPolicy, parse_policy


def runs(rows: list[BenchRow]) -> dict[tuple[int, int, str], list[BenchRow]]:
    """The rows of each (batch, context, policy), one per repeat: by batch, then context, the
    policies of a configuration in the grid's order (a resumed grid saves its new cells first)."""
    out: dict[tuple[int, int, str], list[BenchRow]] = {}
    for r in rows:
        out.setdefault((r.batch, r.context, r.policy), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: kv[0][:2]))  # stable: policy order kept


def ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """``median(num) / median(den)`` and its interval over the repeats, ``(ratio, min(num) /
    max(den), max(num) / min(den))``: every ratio the runs allow (all three equal for one run each).
    The report's own ratios are :func:`run_ratio`'s (the figures of the runs the table shows)."""
    return statistics.median(num) / statistics.median(den), min(num) / max(den), max(num) / min(den)


def median_run(group: list[BenchRow]) -> BenchRow:
    """The run of a (batch, context, policy) that the report shows: the one of median TPOT (of an
    even count the upper middle one, the slower: of two runs, the report never shows the better
    one alone). Every figure of a row comes from this one run, so they agree (decode tok/s is its
    batch / TPOT); a column's per-figure median over an even count would mix two runs."""
    ordered = sorted(group, key=lambda r: r.tpot_ms)
    return ordered[len(ordered) // 2]


def run_ratio(num: list[BenchRow], den: list[BenchRow], key: str) -> tuple[float, float, float]:
    """:func:`ratio` of ``key`` between two policies' runs: the ratio of their :func:`median_run`
    figures (the table's), the interval from the min and max over all the runs."""
    _, lo, hi = ratio([getattr(r, key) for r in num], [getattr(r, key) for r in den])
    return getattr(median_run(num), key) / getattr(median_run(den), key), lo, hi


def format_ratio(r: float, lo: float, hi: float) -> str:
    """``"1.32x [1.10-1.58]"``; ``"within the noise"`` added when the interval holds 1 (the
    repeats do not tell the two apart); the bare ratio when there is no interval (one run each)."""
    if lo == hi == r:
        return f"{r:.2f}x"
    return f"{r:.2f}x [{lo:.2f}-{hi:.2f}{', within the noise' if lo <= 1 <= hi else ''}]"


def _spread_cell(value: float, values: list[float], fmt: str) -> str:
    """``value`` (the median run's), and with more than one run, half the range of ``values`` as a
    percentage of it."""
    if len(values) < 2 or value <= 0:
        return format(value, fmt)
    return f"{format(value, fmt)} ±{50 * (max(values) - min(values)) / value:.0f}%"


def format_table(rows: list[BenchRow]) -> str:
    """One line per (batch, context, policy): the figures of its :func:`median_run` (the run of
    median TPOT), with ``±`` half the spread (max - min) over its repeats as a percentage of that
    run's figure where there is more than one."""
    head = ("batch", "context", "policy", "prefill tok/s", "decode tok/s", "TPOT ms", "x bound", "attn ms/layer", "prep ms/layer", "r",
            "GB/s", "% bound")
    lines = [head]
    repeated = False
    for (b, c, p), group in runs(rows).items():
        ok = [r for r in group if r.fits]
        if not ok:
            lines.append((str(b), str(c), p, f"does not fit: {group[0].reason}") + ("",) * (len(head) - 4))
            continue
        repeated |= len(ok) > 1
        m = median_run(ok)  # every column from this one run
        lines.append((
            str(b), str(c), p, f"{m.prefill_tok_s:,.0f}", _spread_cell(m.step_tok_s, [r.step_tok_s for r in ok], ",.1f"), f"{m.tpot_ms:.2f}",
            f"{m.tpot_ms / m.tpot_bound_ms:.2f}x" if m.tpot_bound_ms > 0 and m.tpot_ms > 0 else "-",
            _spread_cell(m.attn_ms_per_layer, [r.attn_ms_per_layer for r in ok], ".3f"),
            f"{m.prepare_ms_per_layer:.3f}" if m.prepare_ms_per_layer else "-",
            f"{m.r_deployed:.3f}" if m.r_deployed is not None else "-", f"{m.gbs:.1f}",
            f"{100 * m.frac_of_bound:.1f}" if m.frac_of_bound else "-",
        ))
    widths = [max(len(x[i]) for x in lines if not x[3].startswith("does not fit") or i < 3) for i in range(len(head))]
    out = []
    for x in lines:
        if x[3].startswith("does not fit"):
            out.append("  ".join(v.rjust(w) for v, w in zip(x[:3], widths)) + "  " + x[3])
        else:
            out.append("  ".join(v.rjust(w) for v, w in zip(x, widths)))
    if repeated:
        out.append("(over the repeats, each row is its run of median TPOT, of an even count the upper middle (slower) one, every column "
                   "from that run; ±: half their spread, max - min, as a share of that run's figure)")
    out.append("(decode tok/s: batch / TPOT, the decode steps alone; freeing the finished requests' KV after them is not in it)")
    out.append("(r: the CPU's share of the batch's placed KV, its compute region's tokens over both host regions', placed in whole "
               "blocks of D tokens, so a static:R row shows R rounded to blocks at short contexts; monolithic places every block in "
               "the compute region, and its r is the share the CPU reads each step)")
    bounds = {}
    for (b, c, _), group in runs(rows).items():
        ok = [r for r in group if r.fits and r.tpot_bound_ms > 0]
        if ok and (b, c) not in bounds:
            bounds[b, c] = ok[0]
    for (b, c), r in bounds.items():
        line = (f"batch {b} context {c}: the step's host-resident KV takes {r.step_bound_ms:.3g} ms with both paths at once, "
                f"{r.stream_step_bound_ms:.3g} ms streamed alone")
        if r.joint_step_bound_ms > 0:
            line += (f"; with the {r.host_expert_bytes / 1e9:.3g} GB of host experts it hits (expected), "
                     f"{r.joint_step_bound_ms:.3g} ms with both paths at once (x bound: TPOT over that joint bound")
        else:
            line += " (x bound: TPOT over the first"
        out.append(line + "; % bound: the KV bound per layer over the measured attention ms/layer)")
    above = above_bound_note(rows)
    if above:
        out.append(above)
    return "\n".join(out)


def above_bound_note(rows: list[BenchRow]) -> str:
    """A warning line where a run beat its own bound: runs (every repeat, not only the ones the
    table shows) whose attention ran faster than the KV bound per layer (``% bound`` over 100), or
    whose TPOT was under the bound it is compared with (``x bound`` under 1: the joint bound where
    host experts are counted, else the step's KV bound). The bound's rates come from a plain read
    and copy probed once at the start of the run (bench/bounds.py), which the CPU kernel out-read in
    run 65 (72-78 GB/s in the step against 53-70 probed beside the link); a joint bound also
    counts the host experts uniform routing is expected to hit, which real routing may not. Such
    a bound understates the host, and the ratios against it flatter every row alike. Empty when no
    run beat it."""
    over = [r for r in rows if r.fits and (r.frac_of_bound > 1 or 0 < r.tpot_ms < r.tpot_bound_ms)]
    if not over:
        return ""
    worst = max(over, key=lambda r: max(r.frac_of_bound, r.tpot_bound_ms / r.tpot_ms if r.tpot_ms > 0 else 0.0))
    said = ([f"% bound {100 * worst.frac_of_bound:.0f}"] if worst.frac_of_bound > 0 else []) + \
        ([f"x bound {worst.tpot_ms / worst.tpot_bound_ms:.2f}"] if worst.tpot_bound_ms > 0 else [])
    why = "the probe's rates (a plain read and copy at the run's start) understate this host"
    if worst.joint_step_bound_ms > 0 and worst.tpot_ms < worst.tpot_bound_ms:
        why += ", or the host experts uniform routing is expected to hit overstate the real ones"
    return (f"note: {len(over)} of {sum(r.fits for r in rows)} runs beat this run's bound (e.g. batch {worst.batch} context "
            f"{worst.context} {worst.policy}: {', '.join(said)}): {why}; every x bound and % bound here flatters its row alike")


def static_share(policy: str) -> float | None:
    """The fixed CPU share of a static placement: ``gpu`` -> 0, ``cpu`` -> 1 (the same placements
    as ``static:0`` and ``static:1``), ``static:R`` -> R; None for any other policy (as
    :func:`~writescope.scheduler.policies.parse_policy` reads them)."""
    try:
        parsed = parse_policy(policy)
    except ValueError:  # writescope / monolithic without a roofline, or not a policy
        return None
    return parsed.share if isinstance(parsed, StaticPolicy) else None


def computes_host_experts_on_cpu(policy: str) -> bool:
    """Whether ``policy`` (a bench row's name) is a fixed policy (``gpu``, ``cpu``, ``static:R``)
    run with ``@expert_stream_share=0``: its decode steps compute the hit host experts on the CPU
    (on CUDA fixed policies read them in place over PCIe by default)."""
    base, _, switches = policy.partition("@")
    return static_share(base) is not None and any(
        k.strip() == "expert_stream_share" and _is_zero(v) for k, _, v in (s.partition("=") for s in switches.split("+")))


def _is_zero(text: str) -> bool:
    try:
        return float(text) == 0.0
    except ValueError:
        return False


def best_static(rows: list[BenchRow]) -> dict[tuple[int, int], BenchRow]:
    """Per (batch, context): the static row (``gpu``, ``cpu`` or ``static:R``) with the least
    decode attention time per layer (the time the share changes; decode tok/s also holds the
    expert and Python costs of the step, which on the H200 varied by +-15% between runs of the
    same policy); with repeats, each policy's :func:`median_run` (the run its table row shows)."""
    best: dict[tuple[int, int], BenchRow] = {}
    for (b, c, p), group in runs(rows).items():
        ok = [r for r in group if r.fits]
        if ok and static_share(p) is not None:
            r = median_run(ok)
            if r.attn_ms_per_layer <= 0:
                continue
            if (b, c) not in best or r.attn_ms_per_layer < best[(b, c)].attn_ms_per_layer:
                best[(b, c)] = r
    return best


def format_best(rows: list[BenchRow]) -> str:
    """Per (batch, context): the best static share against writescope's deployed r, and
    writescope's speedups over ``gpu`` (attention time, decode tok/s) with their intervals over
    the repeats (:func:`format_ratio`: "within the noise" where the interval holds 1); each
    policy's figures those of its :func:`median_run`, as in the table."""
    best = best_static(rows)
    if not best:
        return ""
    groups = {k: [r for r in g if r.fits] for k, g in runs(rows).items()}
    lines = ["best static share (least attention ms/layer) vs deployed writescope r; writescope's speedups over gpu "
             "(attention, decode tok/s), [min-max over the repeats]:"]
    for (b, c), r in sorted(best.items()):
        w = groups.get((b, c, "writescope")) or []
        g = groups.get((b, c, "gpu")) or groups.get((b, c, "static:0")) or []
        m = median_run(w) if w else None
        dep = m is not None and m.r_deployed is not None
        text = (f"writescope r = {m.r_deployed:.3f}, {m.attn_ms_per_layer:.2f} ms" if dep else
                "no writescope row" if m is None else "writescope's run has no r recorded")
        if dep and g and all(x.attn_ms_per_layer > 0 for x in w) and all(x.step_tok_s > 0 for x in g):
            attn = run_ratio(g, w, "attn_ms_per_layer")
            tok = run_ratio(w, g, "step_tok_s")
            text += f" (attention {format_ratio(*attn)}, decode {format_ratio(*tok)} over gpu)"
            if all(x.r_deployed == 0 for x in w) and not (tok[1] <= 1 <= tok[2]):
                # r 0 places every block as gpu does: the same work, so the difference is the runs'
                text += "; r 0 is gpu's placement, so this difference is between runs, not policies"
        lines.append(f"  batch {b} context {c}: best {r.policy} ({r.attn_ms_per_layer:.2f} ms); {text}")
    if not any(len(g) > 1 for g in groups.values()):
        lines.append("  (one run per configuration: no spread measured, a ratio may be noise; --repeats 3 measures it)")
    return "\n".join(lines)


def format_split_parts(rows: list[BenchRow]) -> str:
    """Per (batch, context, policy) with a CPU part: its attention calls' parts in ms
    (:func:`writescope.bench.runner.split_parts`; with repeats, those of the :func:`median_run`,
    the run the table shows): the whole call, the GPU part, the CPU part and its in-step rate, and
    what is left for the hand-over (the call less the larger side)."""
    lines = []
    for (b, c, p), group in runs(rows).items():
        ok = [r for r in group if r.fits]
        parts = median_run(ok).extra.get("split_parts", {}) if ok else {}
        if "cpu" not in parts:
            continue
        hand = parts["attention"] - max(parts["gpu_part"], parts["cpu"])
        lines.append(f"  batch {b} context {c} {p}: attention {parts['attention']:.2f}, GPU part {parts['gpu_part']:.2f}, "
                     f"CPU {parts['cpu']:.2f} ({parts['cpu_ns_per_token']:.1f} ns/token, {parts['cpu_gbs']:.1f} GB/s), "
                     f"hand-over {hand:.2f}"
                     + (f"; fills copied early: {parts['early_fills']} used, {parts['early_fills_wasted']} copied again"
                        if "early_fills" in parts else ""))
    if not lines:
        return ""
    return "\n".join(["where each decode attention call went (ms per call: a layer of the batch, or of one half with micro-batches; "
                       "GPU part: its window and load-region work before the CPU partial; hand-over: the call less the larger side):"]
                      + lines)


def format_link_copies(rows: list[BenchRow]) -> str:
    """Per (batch, context, policy) that streamed KV on CUDA: the link's rate inside its decode steps
    (:func:`writescope.bench.runner.link_copies`; with repeats, each run's), beside the bound probe's
    stand-alone copy rate where the row has one."""
    lines = []
    for (b, c, p), group in runs(rows).items():
        rates = [r.extra["link_copies"]["link_copy_gbs"] for r in group if r.fits and "link_copies" in r.extra]
        if not rates:
            continue
        alone = next((r.extra["bound_rates_gbs"]["stream"] for r in group if "bound_rates_gbs" in r.extra), None)
        lines.append(f"  batch {b} context {c} {p}: " + ", ".join(f"{x:.1f}" for x in rates) + " GB/s"
                     + (f" (stand-alone copies {alone:.1f} GB/s in this run)" if alone else ""))
    if not lines:
        return ""
    return "\n".join(["the link inside decode steps (the ping-pong fills' copies alone, each after its buffer was free; "
                       "per run):"] + lines)


def _link_sources(x: dict) -> str:
    """Where an expert split's G came from, in words (the split's dict, :func:`format_expert_split`)."""
    read = (f"the slower of the KV copies' {x['link_kv_gbs']:.1f} and the fused kernels' in-place read {x['link_read_gbs']:.1f}"
            if x.get("link_read_gbs") and x.get("link_kv_gbs") else "")
    n, waited = x.get("link_samples") or 0, x.get("link_issue_bound") or 0
    left = (f"; {waited} in-step timing{'s' if waited != 1 else ''} left out: the device waited for the issuing thread"
            if waited else "")
    if not n:
        return (f": {read}" if read else "") + left
    attach = x.get("link_attach_gbs")
    at = f"{attach:.1f}" + (f", {read}" if read else "") if attach else read
    return (f" tracked over {n} in-step timing{'s' if n != 1 else ''} of the in-place read" + (f"; at attach {at}" if at else "")
            + left)


def format_expert_split(rows: list[BenchRow]) -> str:
    """Per (batch, context, policy) whose decode steps split hit host experts between the link and
    the CPU (``extra["expert_split"]``: :func:`writescope.bench.runner.expert_split`; with repeats,
    the :func:`median_run`'s): experts streamed and computed on the CPU per decode step (all
    layers), and the rates the split balanced; empty when no row split."""
    lines = []
    for (b, c, p), group in runs(rows).items():
        ok = [r for r in group if r.fits]
        x = median_run(ok).extra.get("expert_split") if ok else None
        if x:
            lines.append(f"  batch {b} context {c} {p}: {x['streamed_per_step']:.1f} streamed, {x['cpu_per_step']:.1f} on the CPU "
                         f"(E {x['cpu_gbs']:.1f} GB/s + {x.get('cpu_call_ms', 0.0):.2f} ms a call, G {x['link_gbs']:.1f} GB/s"
                         + _link_sources(x) + ")"
                         + ("; expected counts, uniform routing: the split is made on the device, the host counts nothing" if x.get("expected") else ""))
    if not lines:
        return ""
    return "\n".join(["the joint roofline's expert split (hit host experts per decode step, all layers; "
                       "the CPU's and the link's rates of expert weights it balanced them with):"] + lines)


SLOW_STEP = 1.25  # a step this many times its row's median step is named (format_slow_steps)


def format_slow_steps(rows: list[BenchRow]) -> str:
    """Per (batch, context, policy) whose decode steps (``extra["step_ms"]``, in order: the main
    thread's time since the last tokens were sampled, ``extra["between_ms"]``, then its issue +
    wait; with repeats, the :func:`median_run`'s) include one over ``SLOW_STEP`` times their
    median: the median, the mean (what TPOT follows: a request's TPOT is its time from the first
    token to the last over its decode steps) and the slow steps by number (1: the first decode
    step), each with the part before its issue and, with the joint roofline's expert split, the
    host experts it streamed (``extra["expert_split"]["streamed_steps"]``); empty when no row has one."""
    lines = []
    for (b, c, p), group in runs(rows).items():
        ok = [r for r in group if r.fits]
        x = median_run(ok).extra if ok else {}
        steps, between = x.get("step_ms"), x.get("between_ms")
        streamed = (x.get("expert_split") or {}).get("streamed_steps")
        if not steps or len(steps) < 3:
            continue
        mid = statistics.median(steps)
        slow = [k for k, s in enumerate(steps) if s > SLOW_STEP * mid]
        if not slow or mid <= 0:
            continue
        lines.append(f"  batch {b} context {c} {p}: median {mid:.1f}, mean {statistics.fmean(steps):.1f} over {len(steps)} steps; "
                     + ", ".join(f"step {k + 1} {steps[k]:.1f}"
                                 + (f" ({between[k]:.1f} before its issue)" if between and len(between) == len(steps) else "")
                                 + (f" [{streamed[k]:g} host experts streamed]" if streamed and len(streamed) == len(steps) else "")
                                 for k in slow))
    if not lines:
        return ""
    return "\n".join([f"decode steps over {SLOW_STEP}x their row's median (ms on the main thread: the time since the last "
                       "tokens were sampled, then the step's issue and wait; TPOT follows the mean):"] + lines)


def format_pinning(rows: list[BenchRow]) -> str:
    """One line for the grid: what page-locking host memory cost before the rows' timed steps
    (``extra["pinned"]``: registered GB and seconds, GB the pinned pool lent again instead) and
    what freeing each batch took after its last token (``extra["release_ms"]``, not in TPOT);
    empty when nothing was page-locked (no CUDA)."""
    stats = [r.extra["pinned"] for r in rows if r.fits and "pinned" in r.extra]
    reg = sum(p.get("register_bytes", 0) for p in stats)
    reused = sum(p.get("reused_bytes", 0) for p in stats)
    if reg == 0 and reused == 0:
        return ""
    secs = sum(p.get("register_s", 0.0) for p in stats)
    rel = [r.extra["release_ms"] for r in rows if r.fits and "release_ms" in r.extra]
    text = (f"page-locking host memory over the rows: {reg / 1e9:.1f} GB registered in {secs:.1f} s"
            + (f" ({reg / 1e9 / secs:.2f} GB/s)" if secs > 0 else "") + f", {reused / 1e9:.1f} GB lent again by the pinned pool")
    if rel:
        text += f"; freeing a batch after its last token: median {statistics.median(rel) / 1e3:.2f} s (not in TPOT)"
    return text


CPU_EXPERTS = "best static, CPU experts"  # the fixed shares run with @expert_stream_share=0 (computes_host_experts_on_cpu)
BASELINES = ("gpu", "cpu", "monolithic", "best static", CPU_EXPERTS, "best baseline")


def _configurations(rows: list[BenchRow], min_context: int) -> dict[tuple[int, int], dict[str, list[BenchRow]]]:
    """Rows that ran (fit, with a TPOT) at context >= ``min_context``, by (batch, context) and policy."""
    out: dict[tuple[int, int], dict[str, list[BenchRow]]] = {}
    for r in rows:
        if r.context >= min_context and r.fits and r.step_tok_s > 0:
            out.setdefault((r.batch, r.context), {}).setdefault(r.policy, []).append(r)
    return out


def _baselines(by_policy: dict[str, list[BenchRow]]) -> dict[str, list[BenchRow]]:
    """A configuration's baselines (:data:`BASELINES`) from its rows by policy: ``gpu``, ``cpu``,
    ``monolithic``, the best static share, the best with CPU experts and the best of all, each
    chosen by its :func:`median_run`'s decode tok/s (the runs the table shows)."""
    med = {p: median_run(v).step_tok_s for p, v in by_policy.items()}
    base = {p: by_policy[p] for p in med if p in ("gpu", "cpu", "monolithic")}
    statics = [p for p in med if static_share(p) is not None]
    if statics:
        base["best static"] = by_policy[max(statics, key=med.get)]
    cpu_experts = [p for p in med if computes_host_experts_on_cpu(p)]
    if cpu_experts:
        base[CPU_EXPERTS] = by_policy[max(cpu_experts, key=med.get)]
    if base:
        base["best baseline"] = max(base.values(), key=lambda v: median_run(v).step_tok_s)
    return base


def _speedup_ratios(rows: list[BenchRow], min_context: int) -> tuple[dict[str, list[tuple[float, float, float]]], int]:
    """Per baseline, writescope's :func:`ratio` of decode tok/s over it in each (batch, context >=
    ``min_context``) configuration; and the configurations where writescope failed but a baseline ran."""
    failed = {(r.batch, r.context) for r in rows
              if r.context >= min_context and r.policy == "writescope" and not (r.fits and r.step_tok_s > 0)}
    ratios: dict[str, list[tuple[float, float, float]]] = {}
    missed = 0
    for key, by_policy in _configurations(rows, min_context).items():
        base = _baselines(by_policy)
        if "writescope" not in by_policy:
            missed += key in failed and bool(base)
            continue
        for name, v in base.items():
            ratios.setdefault(name, []).append(run_ratio(by_policy["writescope"], v, "step_tok_s"))
    return ratios, missed


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs))


def speedups(rows: list[BenchRow], min_context: int = 8192) -> dict[str, tuple[float, int]]:
    """Geometric mean over the (batch, context >= ``min_context``) configurations of ``writescope``'s
    decode tok/s (:attr:`BenchRow.step_tok_s`, batch / TPOT) divided by each baseline's: ``gpu``, ``cpu``, ``monolithic``, ``best static``
    (per configuration the static share, ``gpu`` and ``cpu`` included, with the most decode
    tok/s), ``best static, CPU experts`` (the same over fixed policies run with
    ``@expert_stream_share=0``: :func:`computes_host_experts_on_cpu`) and ``best baseline`` (the
    most decode tok/s of all of those). The paper's Figure 9
    compares decode throughput this way. Rows repeated for one (batch, context, policy) count as
    their :func:`median_run` (the run the table shows). Returns ``{baseline: (geometric mean, configurations it covers)}`` for baselines
    measured beside at least one writescope row, and ``{"writescope did not fit": (0, n)}`` when
    writescope failed in n configurations where some baseline ran (those are left out of the means)."""
    ratios, missed = _speedup_ratios(rows, min_context)
    out = {n: (_geomean(r for r, _, _ in ratios[n]), len(ratios[n])) for n in BASELINES if n in ratios}
    if missed:
        out["writescope did not fit"] = (0.0, missed)
    return out


def speedup_spread(rows: list[BenchRow], min_context: int = 8192) -> dict[str, tuple[float, float]]:
    """Per baseline of :func:`speedups`, ``(low, high)``: the geometric means of each
    configuration's interval ends (:func:`ratio`, from the min and max of the repeats), so the
    interval every run of every configuration allows; equal to the mean itself without repeats."""
    ratios, _ = _speedup_ratios(rows, min_context)
    return {n: (_geomean(lo for _, lo, _ in ratios[n]), _geomean(hi for _, _, hi in ratios[n])) for n in BASELINES if n in ratios}


def bound_ceiling(rows: list[BenchRow], min_context: int = 8192) -> tuple[float, int] | None:
    """The most ``writescope`` could gain over the best baseline if its step ran at the bound:
    the geometric mean, over the configurations (context >= ``min_context``) with a ``writescope``
    row, a baseline and a bound, of the best baseline's TPOT (its :func:`median_run`, as
    :func:`speedups` chooses it) over the configuration's bound (:attr:`BenchRow.tpot_bound_ms`:
    the joint bound where experts live in host memory, else the step's KV bound with both paths at
    once). ``(ceiling, configurations)``, or None where no configuration has all three. A target
    above it cannot be met on the machine measured."""
    ratios = []
    for group in _configurations(rows, min_context).values():
        ws = [r for r in group.get("writescope", []) if r.tpot_bound_ms > 0]
        best = _baselines(group).get("best baseline")
        if ws and best:
            ratios.append(median_run(best).tpot_ms / median_run(ws).tpot_bound_ms)
    return (_geomean(ratios), len(ratios)) if ratios else None


def format_speedups(rows: list[BenchRow], min_context: int = 8192) -> str:
    s = speedups(rows, min_context)
    if not s:
        return ""
    miss = s.pop("writescope did not fit", None)
    spread = speedup_spread(rows, min_context)
    text = (f"writescope decode tok/s over each baseline, geometric mean over the configurations with context >= {min_context} "
            "(how many) [over the repeats' min-max]: "
            + ", ".join(f"{name} {g:.2f}x ({n})" + (format_ratio(g, *spread[name])[len(f"{g:.2f}x"):]) for name, (g, n) in s.items()))
    if miss:
        text += f"; writescope did not fit in {miss[1]} configuration(s) where a baseline ran (left out)"
    ceiling = bound_ceiling(rows, min_context)
    if ceiling is not None:
        text += (f"; at its bound writescope would be {ceiling[0]:.2f}x the best baseline ({ceiling[1]}): about the most "
                 "these rates allow (the joint bound counts the host experts uniform routing is expected to hit)")
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
        for ax, key, label in ((axes[0][2 * n], "step_tok_s", "decode tok/s (batch / TPOT)"), (axes[0][2 * n + 1], "attn_ms_per_layer", "attention ms per layer")):
            for pol in shown:
                pts = sorted((c, getattr(median_run([r for r in g if r.fits]), key))  # the runs the table shows
                             for (bb, c, pp), g in runs(rows).items() if bb == b and pp == pol and any(r.fits for r in g))
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
        dep = sorted((c, m.r_deployed) for (bb, c, pp), g in runs(rows).items() if bb == b and pp == "writescope"
                     and any(r.fits for r in g) for m in [median_run([r for r in g if r.fits])] if m.r_deployed is not None)
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
