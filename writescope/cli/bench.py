"""``writescope bench``: placement policies side by side over batch sizes and contexts."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from writescope.cli.experts import add_expert_profile_flag, add_stream_share_flag, check_stream_share, stream_share_note
from writescope.cli.outputs import check_output_file

DEFAULT_POLICIES = "gpu,cpu,static:0.5,monolithic,writescope"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="compare KV placement policies: prefill and decode over a grid")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name")
    p.add_argument("--synthetic", action="store_true", help="seeded synthetic weights instead of the checkpoint's")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers (synthetic weights; a shape benchmark)")
    p.add_argument("--batch", default="4", help="comma-separated batch sizes, in sequences (default 4)")
    p.add_argument("--context", default="2k", help="comma-separated prompt lengths, k = 1024 (default 2k)")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="comma-separated policies; POLICY@NAME=VALUE+NAME=VALUE runs one under other switches (writescope/bench/switches.py), "
                        f"e.g. static:0.5@WRITESCOPE_MICRO_BATCHES=2, or with its own expert split, writescope@expert_stream_share=0 "
                        f"(default {DEFAULT_POLICIES})")
    p.add_argument("--steps", type=int, default=8, help="decode steps per configuration (default 8)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every configuration, the policies taking turns (default 3): the table gives each configuration's "
                        "run of median TPOT and the spread over the runs, each speedup its interval over the runs and says "
                        "when it is within the noise")
    p.add_argument("--sweep-static", type=int, default=0, metavar="N", help="also run static:i/N for i = 0..N (the measured best share)")
    p.add_argument("--window", type=int, default=256, help="D (default 256)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--h2d-gbs", type=float, default=None,
                   help="host-to-device GB/s for the bounds, given with --cpu-gbs (default: both measured in this run, "
                        "alone and at once: writescope/bench/bounds.py)")
    p.add_argument("--cpu-gbs", type=float, default=None, help="host read GB/s for the bounds (default: measured in this run)")
    p.add_argument("--vram-budget", default=None, help="device memory the run may use, e.g. 32GiB")
    add_stream_share_flag(p)
    add_expert_profile_flag(p)
    p.add_argument("--kv-fill", choices=("prefill", "random"), default="prefill",
                   help="prefill: run the prompts through the model (default); random: write seeded random KV of the model's "
                        "shape through the cache instead (decode grids without the prefill's time; prefill tok/s is then 0)")
    p.add_argument("--output-json", type=Path, help="write all rows here")
    p.add_argument("--resume", action="store_true",
                   help="keep the (batch, context) cells already complete in --output-json (same model and measuring flags; "
                        "complete: every --policies entry in each --repeats run) and measure only the rest of this grid; "
                        "saved rows of cells outside it stay in the file: a long grid in several runs")
    p.add_argument("--plot", type=Path, help="write the plots here (PNG; needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run, flags={"max_batch": "--batch", "prompt_token_ids": "--context", "max_model_len": "--context"})


def parse_tokens(text: str, flag: str = "token count", one: bool = False) -> list[int]:
    """``"2k,8k,300"`` -> ``[2048, 8192, 300]``; ``flag`` names the option in errors; ``one``: the
    option takes a single count (a list is refused).

    Raises:
        ValueError: an entry that is not a positive integer with an optional k suffix; with
            ``one``, more than one entry.
    """
    example = "32k or 2048" if one else "2k,8k or 2048"
    if one and "," in text:
        raise ValueError(f"{flag} takes one token count, e.g. {example}; got {text!r}")
    out = []
    for part in text.split(","):
        t = part.strip().lower()
        try:
            n = int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
        except (ValueError, OverflowError):  # OverflowError: "infk", "1e400k"
            raise ValueError(f"{flag} {part!r} is not a token count: use e.g. {example}") from None
        if n < 1:
            raise ValueError(f"{flag} must be >= 1, got {part!r}")
        out.append(n)
    return out


def parse_counts(text: str, flag: str) -> list[int]:
    """``"4,16"`` -> ``[4, 16]``: plain positive integers (sequence counts; no k suffix);
    ``flag`` names the option in errors.

    Raises:
        ValueError: an entry that is not a positive integer.
    """
    out = []
    for part in text.split(","):
        t = part.strip()
        if not (t.isascii() and t.isdigit()) or int(t) < 1:  # isdigit: no sign, point, k or "1_0"
            raise ValueError(f"{flag} {text!r}: a comma-separated list of sequence counts, each >= 1, e.g. 4,16")
        out.append(int(t))
    return out


# the flags that decide what a row measures: a resumed grid keeps rows only where they all match
RESUME_KEYS = ("model", "synthetic", "num_layers", "steps", "window", "device", "dtype", "vram_budget", "expert_stream_share",
               "expert_profile", "kv_fill")


def sweep_placement_note(sweep: list[str], contexts: list[int], window: int) -> str | None:
    """A note naming the ``--sweep-static`` shares that place the same whole blocks of a prompt
    (a prompt's compute share is round(R x blocks) whole blocks of D tokens,
    scheduler/policies.py ``prompt_plan``), so that their rows measure one placement under several
    labels; None where every share places its own. E.g. at 1K tokens and D = 256 (4 blocks)
    static:0.125 places as static:0.25."""
    from writescope.scheduler.policies import COMPUTE, parse_policy, prompt_plan

    parts = []
    for ctx in contexts:
        blocks = ctx // window
        same: dict[int, list[str]] = {}
        for s in sweep:
            same.setdefault(prompt_plan(parse_policy(s), ctx, window).count(COMPUTE), []).append(s.split(":", 1)[1])
        groups = [f"{' = '.join(g)} (r {n / blocks:.3g})" for n, g in same.items() if len(g) > 1 and blocks]
        if groups:
            parts.append(f"at {ctx:,} tokens ({blocks} blocks of D = {window}) static:{'; static:'.join(groups)}")
    if not parts:
        return None
    return ("note: --sweep-static places whole blocks, so some of its shares place the same prompt blocks "
            f"and their rows measure one placement under several labels: {'; '.join(parts)} "
            "(the r column shows the share placed; more blocks: a longer --context or a smaller --window)")


def saved_rows(args: argparse.Namespace) -> list:
    """The rows of ``--output-json`` for ``--resume`` (none where the file does not exist yet).

    Raises:
        ValueError: no --output-json; a file that is not a bench JSON; rows measured with other
            measuring flags (each named with both values).
    """
    from writescope.bench.runner import BenchRow

    if args.output_json is None:
        raise ValueError("--resume needs --output-json: the file whose complete cells are kept")
    if not args.output_json.exists():
        return []
    try:
        doc = json.loads(args.output_json.read_text())
        old, rows = doc["args"], [BenchRow.from_dict(r) for r in doc["rows"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume: {args.output_json} is not a bench JSON this version reads ({e}): use another --output-json") from None
    now = {k: str(getattr(args, k)) for k in RESUME_KEYS}
    diff = [f"--{k.replace('_', '-')} {old.get(k)!s} there, {now[k]} now" for k in RESUME_KEYS if old.get(k) != now[k]]
    if diff:
        raise ValueError(f"--resume: the rows in {args.output_json} were measured otherwise ({'; '.join(diff)}): "
                         "give the same flags or another --output-json")
    return rows


def run(args: argparse.Namespace) -> int:
    from writescope.bench.report import format_best, format_expert_split, format_link_copies, format_pinning, format_slow_steps, format_speedups, format_split_parts, format_table, plot, speedup_spread, speedups
    from writescope.bench.runner import BenchConfig, complete_cells, run_grid
    from writescope.engine.llm import LLM
    from writescope.engine.model_loader import capped_model_len
    from writescope.engine.threads import busy_note
    from writescope.scheduler.policies import parse_policy

    remedy = "OMP_WAIT_POLICY=passive, OMP_NUM_THREADS=1, or a lower WRITESCOPE_CPU_THREADS,"
    busy = busy_note(remedy)  # before this run's own threads add to the load (where the run cannot be measured)

    batches, contexts = parse_counts(args.batch, "--batch"), parse_tokens(args.context, "--context")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install matplotlib (or the project's [plot] extra)")
    from writescope.bench import bounds, switches

    if (args.h2d_gbs is None) != (args.cpu_gbs is None):
        raise ValueError("give both --h2d-gbs and --cpu-gbs, or neither (then both are measured in this run)")
    if args.h2d_gbs is not None:
        bounds.given(args.h2d_gbs, args.cpu_gbs, True)  # checked before the model loads

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:  # else nothing is measured and the table is empty
        raise ValueError(f"--policies {args.policies!r} names no policy: give a comma-separated list, e.g. the default {DEFAULT_POLICIES}")
    needs_roofline = any(switches.split(p)[0].lower() in ("writescope", "monolithic") for p in policies)
    for p in policies:
        switches.check(p)  # unknown switches and bad values fail before the model loads
        if switches.split(p)[0].lower() not in ("writescope", "monolithic"):
            parse_policy(switches.split(p)[0])  # a bad name fails before the model loads
    check_stream_share(args)
    check_output_file(args.output_json, "--output-json")  # before the model loads, not after the grid
    done = saved_rows(args) if args.resume else []
    limit = capped_model_len(args.model, 2**62, args.num_layers, args.synthetic)  # the model's positions (its config only)
    if min(contexts) + args.steps + 1 > limit:  # no row could fit: say so before the weights load
        fix = (f"use a --context of at most {limit - args.steps - 1:,}" if limit - args.steps - 1 >= 1 else
               f"use --steps of at most {limit - 2:,}")
        raise ValueError(f"--context {min(contexts):,}: with --steps {args.steps:,} a request reaches {min(contexts) + args.steps + 1:,} "
                         f"tokens, beyond the {limit:,} positions of {args.model}: {fix}")
    check_output_file(args.plot, "--plot")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.sweep_static < 0:
        raise ValueError(f"--sweep-static must be >= 0, got {args.sweep_static}")
    sweep = [f"static:{i / args.sweep_static:g}" for i in range(args.sweep_static + 1)] if args.sweep_static else []
    grid_policies = policies + [s for s in sweep if s not in policies]
    if sweep and (note := sweep_placement_note(sweep, contexts, args.window)) is not None:
        print(note, flush=True)
    t0 = time.perf_counter()
    llm = LLM(args.model, synthetic=args.synthetic, device=args.device, dtype=args.dtype, progress=not args.quiet,
              # sized for windows + ping-pong (any partitioned policy); an adaptive one is calibrated
              # before the weights load (after them a --vram-budget cap leaves no room for it)
              policy="writescope" if needs_roofline else "gpu", window=args.window,
              vram_budget=args.vram_budget, max_batch=max(batches), num_layers=args.num_layers,
              expert_stream_share=args.expert_stream_share, expert_profile=args.expert_profile,
              # what the grid's requests reach (the budget plans for it); longer rows report they do not fit
              max_model_len=capped_model_len(args.model, max(contexts) + args.steps + 1, args.num_layers, args.synthetic))
    if args.num_layers is not None and not llm.config.moe.moe_layers:
        print(f"note: the first {args.num_layers} layer(s) of {args.model} hold no MoE block (dense layers first): "
              "raise --num-layers for the expert phase", flush=True)
    if (note := stream_share_note(args.expert_stream_share, llm)) is not None:
        print(note, flush=True)
    roofline = llm.roofline(args.window) if needs_roofline else None
    calibration = None if roofline is None else llm.stored_calibration(args.window)
    if llm.vram_plan is not None:
        print(f"{llm.vram_plan.placement_line()} ({llm.host_experts_in_decode()})", flush=True)
    if args.h2d_gbs is None:
        rates = bounds.measure(llm.device)
    else:
        rates = bounds.given(args.h2d_gbs, args.cpu_gbs, llm.device.type == "cuda")
    print(rates.line(), flush=True)
    cfg = BenchConfig(batches, contexts, grid_policies, args.steps, args.window, rates=rates, progress=not args.quiet,
                      kv_fill=args.kv_fill, repeats=args.repeats)
    sweep_only = {s for s in sweep if s not in policies}

    # --resume: the saved rows of cells this grid does not measure stay in the file as they are
    grid_cells = {(b, c) for b in batches for c in contexts}
    outside = [r for r in done if (r.batch, r.context) not in grid_cells]

    def save(rows) -> None:  # after every configuration, so an interrupted grid keeps what it measured
        for r in rows:
            r.extra["sweep"] = r.policy in sweep_only
        rows = rows + outside
        if args.output_json:
            spread = speedup_spread(rows)
            doc = {"model": args.model, "num_layers": llm.config.num_layers, "device": str(llm.device), "dtype": str(llm.dtype),
                   "args": {k: str(v) for k, v in vars(args).items() if k != "run"},
                   "roofline": None if roofline is None else vars(roofline), "calibration": calibration,
                   "bound_rates": rates.to_dict(),
                   "complete": len(rows) == cfg_size,
                   "vram_plan": None if llm.vram_plan is None else {"budget_bytes": llm.vram_plan.budget, "experts_gpu": llm.vram_plan.experts_gpu,
                                                                    "experts_total": llm.vram_plan.experts_total,
                                                                    "expert_stream_share": llm.expert_stream_share},
                   "speedups_geomean_8k": {k: {"geomean": g, "configurations": n, "min_max_over_repeats": spread.get(k)}
                                           for k, (g, n) in speedups(rows).items()},
                   "rows": [r.to_dict() for r in rows]}
            tmp = args.output_json.with_name(args.output_json.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(args.output_json)  # an interrupted write never leaves a broken file

    cfg_size = len(batches) * len(contexts) * len(grid_policies) * args.repeats
    if args.resume:
        kept = complete_cells(cfg, done)
        cells = len({(r.batch, r.context) for r in kept})
        print(f"--resume: {cells} of {len(grid_cells)} (batch, context) cell(s) complete in {args.output_json} "
              f"({len(kept)} rows kept; a cell is complete with a row for every --policies entry in each of the "
              f"{args.repeats} --repeats run(s)); measuring the rest; {len(outside)} saved row(s) of other cells kept as they are"
              + ("; kept rows carry their own run's bound rates (extra.bound_rates_gbs)" if kept else ""), flush=True)
    from writescope.engine.cpu_competition import CpuCompetition

    competition = CpuCompetition()  # what other processes take of this process's CPUs while the rows are timed
    rows = run_grid(llm, cfg, roofline, on_row=save, done=done)
    busy = competition.note_or(busy, remedy)
    save(rows)  # also when every cell was kept: the file then holds what the table shows
    n = llm.config.num_layers
    print(f"\n{args.model} ({n} layer{'s' if n != 1 else ''}, {llm.dtype} on {llm.device}), {args.steps} decode steps per configuration, "
          f"{args.repeats} run{'s' if args.repeats != 1 else ''} of each, "
          f"D = {args.window}; {time.perf_counter() - t0:.0f} s in all")
    print(format_table(rows))
    if llm.device.type == "cpu":
        print("note: on the CPU the 'GPU' side runs as CPU tensors: these timings and speedups say nothing about a GPU machine")
    if busy is not None:
        print(busy)
    if args.kv_fill == "random":
        print("prefill tok/s is 0: --kv-fill random wrote the prompts' KV as random values without running the prompts")
    meter = getattr(llm, "other_work", None)
    other = {b: {p: meter.seconds(b, p) for p in ("", "cpu", "link")} for b in batches} if meter is not None else {}
    words = {"": "", "cpu": " host experts on the CPU", "link": " host experts over the link"}
    parts = [f"batch {b}{words[p]} {o * 1e3:.3g} ms" for b, by in other.items() for p, o in by.items() if o is not None]
    if parts:  # what writescope's split gate and balance counted (scheduler/other_work.py)
        print("work outside attention per decode layer step (O, measured in decode steps, on CUDA also kept from earlier runs, "
              "per path of the host experts; writescope's split gate counts it, and its balance without micro-batches): "
              + ", ".join(parts))
    if roofline is not None and meter is not None:  # which A placed writescope's prompts (scheduler/other_work.py)
        token = llm.config.kv_layout.bytes_per_token(llm.dtype.itemsize)

        def per_token(a: float) -> str:
            return f"{a * 1e9:.3g} ns/token" + (f" ({token / a / 1e9:.3g} GB/s of KV read)" if a > 0 else "")

        kept = meter.in_step_a(llm.attention_threads)
        print(f"A (CPU attention per placed token, {llm.attention_threads} thread(s), every batch; rows without @switches, "
              f"those with their own kernel switches keep theirs apart, @WRITESCOPE_LINK_FIXED rows share them): calibration {per_token(roofline.a)}; "
              + (f"in-step {per_token(kept)}, kept from decode steps: a writescope row placed its prompts with the one kept "
                 "before it (the first row: one kept earlier, by an earlier run or the warm-up, else the calibration's)" if kept is not None
                 else "no in-step A kept: writescope placed its prompts with the calibration's"))
        kept_c = {b: meter.in_step_c(llm.attention_threads, b) for b in batches}
        print(f"C_cpu (the CPU part's fixed cost a layer step, learnt from small parts, per batch size): calibration "
              f"{roofline.c_cpu * 1e3:.3g} ms; "
              + ("in-step, kept at the end from decode steps: " + ", ".join(f"batch {b} {c * 1e3:.3g} ms" for b, c in kept_c.items() if c is not None)
                 + " (a writescope row placed its prompts with the one kept before it, else the calibration's)"
                 if any(c is not None for c in kept_c.values()) else "none kept in-step: writescope placed its prompts with the calibration's"))
    for fmt, lead in ((format_split_parts, ""), (format_link_copies, ""), (format_expert_split, ""), (format_slow_steps, ""), (format_pinning, ""),
                      (format_best, "\n"), (format_speedups, "")):
        text = fmt(rows)  # each empty where no row has what it reports
        if text:
            print(lead + text)
    if args.output_json:
        print(f"wrote {args.output_json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0
