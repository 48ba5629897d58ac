"""``writescope plan``: where every byte of a run would live under a GPU budget."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="print the GPU and host memory plan of a run under a VRAM budget")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name (only its config is read)")
    p.add_argument("--vram-budget", required=True, help="GPU memory the run may use, e.g. 32GiB or 32G (2^30 bytes a GiB; 32GB is 32 x 10^9 bytes)")
    p.add_argument("--batch", type=int, required=True, help="sequences")
    p.add_argument("--context", required=True, help="prompt tokens per sequence, e.g. 32k")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per sequence (default 256)")
    p.add_argument("--policy", default="writescope", help="KV placement policy: resident, gpu, cpu, static:R, writescope, monolithic[:R] (default writescope, the policy of long-context runs, as in profile; generate defaults to resident: pass the policy the run will use)")
    p.add_argument("--window", type=int, default=256, help="D (default 256)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=8192,
                   help="prompt tokens per prefill pass: sizes the activations (default 8192, generate's; serve's is 2048)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16, fp32, or auto (as on cuda: bf16)")
    p.add_argument("--host-memory", default=None,
                   help="host memory free on the machine that will run it, e.g. 125GiB (default: what this machine has free)")
    p.add_argument("--expert-profile", default=None, metavar="PATH",
                   help="a routing profile (`writescope expert-profile`): show what the GPU experts serve placed by it")
    p.set_defaults(run=run)


def check_model_limit(model: str, limit: int, context: int, max_new_tokens: int) -> None:
    """Each sequence holds ``context + max_new_tokens`` tokens, at most the model's ``limit``
    (its max_position_embeddings).

    Raises:
        ValueError: past the limit, naming the largest --context that fits with this
            --max-new-tokens (or, when none does, the most --max-new-tokens there is room for).
    """
    total = context + max_new_tokens
    if total <= limit:
        return
    fits = limit - max_new_tokens  # flag values stay plain (a comma separates --context's list)
    room = (f"the largest --context that fits with --max-new-tokens {max_new_tokens} is {fits}, "
            f"or lower --max-new-tokens to {limit - context} for --context {context}" if fits >= 1 and context < limit
            else f"the largest --context that fits with --max-new-tokens {max_new_tokens} is {fits}" if fits >= 1
            else f"--max-new-tokens must stay below {limit}")
    raise ValueError(f"--context {context} + --max-new-tokens {max_new_tokens} = {total:,} tokens per sequence passes {model}'s "
                     f"limit of {limit:,} tokens (its max_position_embeddings): {room}")


def run(args: argparse.Namespace) -> int:
    import torch

    from writescope.budget.plan import format_plan, make_plan, parse_size
    from writescope.units import parse_budget
    from writescope.cli.bench import parse_tokens
    from writescope.engine.llm import available_memory
    from writescope.engine.model_loader import parse_dtype, resolve_config
    from writescope.kvcache.spec import Roofline
    from writescope.scheduler.policies import parse_policy

    try:
        budget = parse_budget(args.vram_budget)
    except ValueError as e:
        raise ValueError(f"--vram-budget: {e}") from None
    (context,) = parse_tokens(args.context, "--context", one=True)
    for flag, value in (("--batch", args.batch), ("--window", args.window), ("--max-new-tokens", args.max_new_tokens),
                        ("--prefill-chunk-tokens", args.prefill_chunk_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    policy = parse_policy(args.policy, roofline=Roofline(1.0, 1.0))  # the share does not change the worst-case sizes
    from writescope.engine.switches import check_switches

    check_switches()  # as generate and bench: a bad WRITESCOPE_* value refused, a misspelt one named
    cfg, _ = resolve_config(args.model)
    check_model_limit(args.model, cfg.max_position_embeddings, context, args.max_new_tokens)
    dtype = parse_dtype(args.dtype, torch.device("cuda"))
    host = parse_size(args.host_memory) if args.host_memory else available_memory(torch.device("cpu"))
    plan = make_plan(cfg, dtype, budget, args.batch, context, args.max_new_tokens, policy, args.window,
                     prefill_chunk_tokens=args.prefill_chunk_tokens, host_free=host)
    print(f"{args.model}: batch {args.batch} x ({context} + {args.max_new_tokens}) tokens, policy {args.policy}, {dtype}, D = {args.window}")
    print(format_plan(plan, cfg))
    if args.expert_profile:
        from writescope.budget.apply import coverage_line
        from writescope.moe.popularity import ExpertProfile

        print(coverage_line(cfg, plan, ExpertProfile.load(args.expert_profile)))
    if not args.host_memory:
        print("(host free is this machine's; plan for another with --host-memory)")
    plan.check()
    print("the plan fits")
    return 0
