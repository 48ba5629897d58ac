"""``writescope profile``: where the time of a decode step goes (see :mod:`writescope.bench.breakdown`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from writescope.cli.experts import add_expert_profile_flag, add_stream_share_flag, check_stream_share
from writescope.cli.outputs import check_output_file


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="break a decode step down into attention, experts, KV writes and the rest")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name")
    p.add_argument("--synthetic", action="store_true", help="seeded synthetic weights instead of the checkpoint's")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers (synthetic weights)")
    p.add_argument("--batch", type=int, default=4, help="sequences in the profiled batch (default 4)")
    p.add_argument("--context", default="2k", help="prompt tokens per request, k = 1024 (default 2k)")
    p.add_argument("--policy", default="writescope", help="KV placement policy: resident, gpu, cpu, static:R, writescope, monolithic[:R] (default writescope, the policy of long-context runs, as in plan; generate defaults to resident)")
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled (default 8)")
    p.add_argument("--skip", type=int, default=2, help="decode steps run before profiling (default 2)")
    p.add_argument("--window", type=int, default=256, help="D (default 256)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--vram-budget", default=None, help="device memory the run may use, e.g. 32GiB")
    add_stream_share_flag(p)
    add_expert_profile_flag(p)
    p.add_argument("--trace", type=Path, help="also write a Chrome trace here")
    p.add_argument("--output-json", type=Path, help="write the breakdown here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run, flags={"max_batch": "--batch", "prompt_token_ids": "--context", "max_model_len": "--context"})


def run(args: argparse.Namespace) -> int:
    import torch

    from writescope.bench.breakdown import decode_breakdown
    from writescope.cli.bench import parse_tokens
    from writescope.engine.llm import LLM
    from writescope.engine.model_loader import capped_model_len

    (context,) = parse_tokens(args.context, "--context")
    if args.batch < 1 or args.steps < 1 or args.skip < 0:
        raise ValueError(f"--batch and --steps must be >= 1 and --skip >= 0, got {args.batch}, {args.steps}, {args.skip}")
    check_stream_share(args)
    check_output_file(args.output_json, "--output-json")  # before the model loads, not after the run
    check_output_file(args.trace, "--trace")
    llm = LLM(args.model, synthetic=args.synthetic, device=args.device, dtype=args.dtype, progress=not args.quiet,
              policy=args.policy, window=args.window, vram_budget=args.vram_budget, max_batch=args.batch,
              num_layers=args.num_layers, expert_stream_share=args.expert_stream_share, expert_profile=args.expert_profile,
              kv_tokens=args.batch * (context + 2 + args.skip + args.steps),  # counted in the memory check before the build; the budget plans for the profiled requests, not the model's limit
              max_model_len=capped_model_len(args.model, context + 2 + args.skip + args.steps, args.num_layers, args.synthetic))
    if llm.vram_plan is not None:
        print(f"{llm.vram_plan.placement_line()} ({llm.host_experts_in_decode()})", flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, llm.config.vocab_size, (args.batch, context), generator=g).tolist()
    bd = decode_breakdown(llm, prompts, args.steps, args.skip, str(args.trace) if args.trace else None)
    n = llm.config.num_layers
    print(f"{args.model} ({n} layer{'s' if n != 1 else ''}, {llm.dtype} on {llm.device}), batch {args.batch} x {context} tokens, "
          f"policy {llm.policy_name}")
    print(bd.table())
    if args.output_json:
        args.output_json.write_text(json.dumps({"model": args.model, "num_layers": n, "batch": args.batch, "context": context,
                                                "policy": llm.policy_name, "expert_stream_share": llm.expert_stream_share,
                                                "step_ms": bd.step_ms, "steps": bd.steps, "other_ms": bd.other_ms,
                                                "ranges": {k: dataclasses.asdict(t) for k, t in bd.ranges.items()}},
                                               indent=1))
        print(f"wrote {args.output_json}")
    if args.trace:
        print(f"wrote {args.trace}")
    return 0
