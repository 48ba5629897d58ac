"""``writescope profile``: where the time of a decode step goes (see :mod:`writescope.bench.breakdown`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from writescope.cli.experts import add_expert_profile_flag, add_stream_share_flag, check_stream_share, stream_share_note
from writescope.cli.outputs import check_output_file


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="break a decode step down into attention, experts, KV writes and the rest")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name")
    p.add_argument("--synthetic", action="store_true", help="seeded synthetic weights instead of the checkpoint's")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers (synthetic weights)")
    p.add_argument("--batch", type=int, default=4, help="sequences in the profiled batch (default 4)")
    p.add_argument("--context", default="2k", help="prompt tokens per request, k = 1024 (default 2k)")
    p.add_argument("--policy", default="writescope", help="KV placement policy: resident, gpu, cpu, static:R, writescope, monolithic[:R] (default writescope, the policy of long-context runs, as in plan; generate defaults to resident); several, comma-separated, each with its own switches as in bench (POLICY@NAME=VALUE+...), are profiled one after another on the loaded model, and --trace / --timeline files get the policy in their names")
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled (default 8)")
    p.add_argument("--skip", type=int, default=2, help="decode steps run before profiling (default 2)")
    p.add_argument("--window", type=int, default=256, help="D (default 256)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--vram-budget", default=None, help="device memory the run may use, e.g. 32GiB")
    add_stream_share_flag(p)
    add_expert_profile_flag(p)
    p.add_argument("--trace", type=Path, help="also write a Chrome trace here")
    p.add_argument("--timeline", type=Path, help="then lay as many decode steps out in time, profiling the device only (the CPU "
                   "worker's jobs, the compute stream's kernels and its waits for the CPU, the link's copies, the main thread "
                   "entering each layer's attention; writescope/bench/timeline.py): print where each side waits and plot the first "
                   "step as this PNG")
    p.add_argument("--host-profile", type=Path, help="then profile the main thread's Python (cProfile) over as many decode steps: "
                   "where the thread that issues a step spends its time (writescope/bench/host_profile.py); print the top "
                   "functions and write pstats' whole listing here (a .txt file)")
    p.add_argument("--no-breakdown", action="store_true", help="with --timeline or --host-profile: only those (no profiled breakdown first)")
    p.add_argument("--kv-fill", choices=("prefill", "random"), default="prefill",
                   help="prefill: run the prompts (default); random: write their KV as seeded random values through the "
                        "cache instead (full-size decode without the prefill's time; as writescope bench --kv-fill)")
    p.add_argument("--output-json", type=Path, help="write the breakdown here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run, flags={"max_batch": "--batch", "prompt_token_ids": "--context", "max_model_len": "--context",
                                   "kv_tokens": "--batch, --context or --steps"})


def _suffixed(path: Path | None, entry: str, many: bool) -> Path | None:
    """``path`` itself for one policy; with several, ``stem_<policy>.suffix`` for each."""
    if path is None or not many:
        return path
    slug = "".join(c if c.isalnum() or c in "._-" else "_" for c in entry)
    return path.with_name(f"{path.stem}_{slug}{path.suffix}")


def run(args: argparse.Namespace) -> int:
    import os

    # the profiler's own info lines ("USDT: ... profiler_start") on stderr, once per profiled pass:
    # kineto reads its log level when the profiler first starts (6: errors only); a value the user set stays
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    import torch

    from writescope.bench import switches
    from writescope.bench.breakdown import decode_breakdown
    from writescope.bench.host_profile import main_thread_profile
    from writescope.bench.timeline import decode_timeline, format_summary, plot, to_json
    from writescope.cli.bench import parse_tokens
    from writescope.engine.llm import LLM
    from writescope.engine.model_loader import capped_model_len
    from writescope.kvcache.spec import Roofline
    from writescope.scheduler.policies import parse_policy

    (context,) = parse_tokens(args.context, "--context", one=True)
    if args.batch < 1 or args.steps < 1 or args.skip < 0:
        raise ValueError(f"--batch and --steps must be >= 1 and --skip >= 0, got {args.batch}, {args.steps}, {args.skip}")
    entries = [e.strip() for e in args.policy.split(",") if e.strip()]
    if not entries:
        raise ValueError(f"--policy needs at least one policy, got {args.policy!r}")
    if len(set(entries)) < len(entries):
        raise ValueError(f"--policy names a policy twice ({args.policy!r}): each is profiled once, into files named after it")
    for entry in entries:  # every policy and switch checked before the model loads, not after the first's run
        switches.check(entry)
        parse_policy(switches.split(entry)[0], Roofline(a=1.0, b=1.0))  # a stand-in roofline: only the name is checked here
    many = len(entries) > 1
    if args.no_breakdown and args.timeline is None and args.host_profile is None:
        raise ValueError("--no-breakdown leaves only the timeline or the host profile: give --timeline PNG or --host-profile TXT too")
    if args.no_breakdown and args.trace is not None:
        raise ValueError("--trace is the breakdown's trace: leave out --no-breakdown, or --trace")
    if args.timeline is not None and args.timeline.suffix.lower() != ".png":
        raise ValueError(f"--timeline writes a PNG: give a path ending in .png, got {str(args.timeline)!r}")
    if args.host_profile is not None and args.host_profile.suffix.lower() in (".png", ".jpg", ".jpeg", ".svg", ".pdf", ".json"):
        raise ValueError(f"--host-profile writes text (pstats' listing): give a path ending in .txt, got {str(args.host_profile)!r}")
    if args.timeline is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--timeline plots with matplotlib: pip install matplotlib (or the project's [plot] extra)")
    check_stream_share(args)
    extra = 2 + args.skip + args.steps  # the tokens the profiled run generates per request
    limit = capped_model_len(args.model, 2**62, args.num_layers, args.synthetic)  # the model's positions (its config only)
    if context + extra > limit:  # before the weights load
        fix = (f"use a --context of at most {limit - extra:,}" if limit - extra >= 1 else
               f"use --skip and --steps that add up to at most {limit - 3:,}")  # a prompt of 1 token, and 2 more generated
        raise ValueError(f"--context {context:,}: with --skip {args.skip} and --steps {args.steps} a request reaches "
                         f"{context + extra:,} tokens ({extra} generated), beyond the {limit:,} positions of {args.model}: {fix}")
    check_output_file(args.output_json, "--output-json")  # before the model loads, not after the run
    for entry in entries:
        check_output_file(_suffixed(args.trace, entry, many), "--trace")
        check_output_file(_suffixed(args.timeline, entry, many), "--timeline")
        check_output_file(_suffixed(args.host_profile, entry, many), "--host-profile")
    first, first_sw = switches.split(entries[0])
    first_env, _ = switches.settings(first_sw)
    with switches.applied(first_env):
        llm = LLM(args.model, synthetic=args.synthetic, device=args.device, dtype=args.dtype, progress=not args.quiet,
                  policy=first, window=args.window, vram_budget=args.vram_budget, max_batch=args.batch,
                  num_layers=args.num_layers, expert_stream_share=args.expert_stream_share, expert_profile=args.expert_profile,
                  kv_tokens=args.batch * (context + 2 + args.skip + args.steps),  # counted in the memory check before the build; the budget plans for the profiled requests, not the model's limit
                  max_model_len=capped_model_len(args.model, context + 2 + args.skip + args.steps, args.num_layers, args.synthetic))
    if llm.vram_plan is not None:
        print(f"{llm.vram_plan.placement_line()} ({llm.host_experts_in_decode()})", flush=True)
    if (note := stream_share_note(args.expert_stream_share, llm)) is not None:
        print(note, flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, llm.config.vocab_size, (args.batch, context), generator=g).tolist()
    if args.kv_fill == "random":
        from writescope.bench.runner import random_kv_prefill

        llm._prefill = random_kv_prefill(llm, 0)  # an instance attribute over the method, for this run only
    n = llm.config.num_layers
    runs = []
    for i, entry in enumerate(entries):
        policy, sw = switches.split(entry)
        env, settings = switches.settings(sw)  # environment switches; engine settings (expert_stream_share), as bench's rows
        trace, timeline = _suffixed(args.trace, entry, many), _suffixed(args.timeline, entry, many)
        host = _suffixed(args.host_profile, entry, many)
        with switches.applied(env):
            share = settings.get("expert_stream_share", llm.expert_stream_share_at_load)  # an entry without its own: the run's
            if share != llm.expert_stream_share_given:  # set_policy below attaches the per-step split for it
                llm.set_expert_stream_share(share, attach=False)
            if i or share != llm.expert_stream_share_at_load:  # the first policy's cache was made with the model
                llm.set_policy(policy, args.window)
            bd = None if args.no_breakdown else decode_breakdown(llm, prompts, args.steps, args.skip, str(trace) if trace else None)
            tl = decode_timeline(llm, prompts, args.steps, args.skip) if timeline is not None else None
            hp = main_thread_profile(llm, prompts, args.steps, args.skip) if host is not None else None
        name = llm.policy_name + (f" @ {'+'.join(f'{k}={v}' for k, v in sw.items())}" if sw else "")
        print(f"{args.model} ({n} layer{'s' if n != 1 else ''}, {llm.dtype} on {llm.device}), batch {args.batch} x {context} tokens, "
              f"policy {name}")
        if bd is not None:
            print(bd.table())
        if tl is not None:
            print(format_summary(tl))
            if tl.steps:
                plot(tl.steps[0], str(timeline), f"{args.model}, batch {args.batch} x {context}, policy {name}: one decode step")
                print(f"wrote {timeline}")
        if hp is not None:
            print(hp.table())
            host.write_text(hp.text)
            print(f"wrote {host}")
        if trace:
            print(f"wrote {trace}")
        runs.append({"policy": llm.policy_name, "entry": entry, "expert_stream_share": llm.expert_stream_share,
                     **({"step_ms": bd.step_ms, "step_mean_ms": bd.mean_ms, "steps": bd.steps, "other_ms": bd.other_ms,
                         "ranges": {k: dataclasses.asdict(t) for k, t in bd.ranges.items()}} if bd is not None else {}),
                     **({"timeline": to_json(tl)} if tl is not None else {}),
                     **({"host_profile": hp.to_json()} if hp is not None else {})})
    if args.output_json:
        head = {"model": args.model, "num_layers": n, "batch": args.batch, "context": context, "kv_fill": args.kv_fill}
        args.output_json.write_text(json.dumps({**head, **runs[0]} if not many else {**head, "runs": runs}, indent=1))
        print(f"wrote {args.output_json}")
    return 0
