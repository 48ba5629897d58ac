"""``writescope plan``: where every byte of a run would live under a GPU budget."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="print the GPU and host memory plan of a run under a VRAM budget")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name (only its config is read)")
    p.add_argument("--vram-budget", required=True, help="GPU memory the run may use, e.g. 32GiB")
    p.add_argument("--batch", type=int, required=True, help="sequences")
    p.add_argument("--context", required=True, help="prompt tokens per sequence, e.g. 32k")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per sequence (default 256)")
    p.add_argument("--policy", default="writescope", help="KV placement policy: resident, gpu, cpu, static:R, writescope, monolithic[:R] (default writescope, the policy of long-context runs, as in profile; generate defaults to resident: pass the policy the run will use)")
    p.add_argument("--window", type=int, default=256, help="D (default 256)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--host-memory", default=None,
                   help="host memory free on the machine that will run it, e.g. 125GiB (default: what this machine has free)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from writescope.budget.plan import format_plan, make_plan, parse_size
    from writescope.cli.bench import parse_tokens
    from writescope.engine.llm import available_memory
    from writescope.engine.model_loader import parse_dtype, resolve_config
    from writescope.kvcache.spec import Roofline
    from writescope.scheduler.policies import parse_policy

    try:
        budget = parse_size(args.vram_budget)
    except ValueError as e:
        raise ValueError(f"--vram-budget: {e}") from None
    (context,) = parse_tokens(args.context, "--context")
    for flag, value in (("--batch", args.batch), ("--window", args.window), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    policy = parse_policy(args.policy, roofline=Roofline(1.0, 1.0))  # the share does not change the worst-case sizes
    cfg, _ = resolve_config(args.model)
    if context + args.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"--context {context} + --max-new-tokens {args.max_new_tokens} passes {args.model}'s limit of "
                         f"{cfg.max_position_embeddings} tokens: lower the context")
    dtype = parse_dtype(args.dtype, torch.device("cuda"))
    host = parse_size(args.host_memory) if args.host_memory else available_memory(torch.device("cpu"))
    plan = make_plan(cfg, dtype, budget, args.batch, context, args.max_new_tokens, policy, args.window, host_free=host)
    print(f"{args.model}: batch {args.batch} x ({context} + {args.max_new_tokens}) tokens, policy {args.policy}, {dtype}, D = {args.window}")
    print(format_plan(plan, cfg))
    if not args.host_memory:
        print("(host free is this machine's; plan for another with --host-memory)")
    plan.check()
    print("the plan fits")
    return 0
