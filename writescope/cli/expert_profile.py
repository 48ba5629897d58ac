"""``writescope expert-profile``: count which routed experts the model's router picks over some
text, and write the profile that ``--expert-profile`` places experts by (moe/popularity.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("expert-profile", help="count the routing of every MoE layer over text; write a profile for --expert-profile")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name")
    p.add_argument("--synthetic", action="store_true", help="seeded synthetic weights (they route nearly uniformly: for trying it out)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-file", type=Path, help="text to route (UTF-8)")
    src.add_argument("--machine-text", metavar="TOKENS", default="8k",
                     help="route this many tokens of this machine's Python text (default 8k)")
    p.add_argument("--out", type=Path, required=True, help="the profile to write (JSON)")
    p.add_argument("--device", default="auto", help="auto (default: cuda if available), cuda or cpu")
    p.add_argument("--dtype", default="auto", help="auto (default: bf16 on CUDA, fp32 on CPU), bf16, fp16 or fp32")
    p.add_argument("--vram-budget", default=None, help="GPU memory the pass may use, e.g. 32GiB (the routing does not depend on it)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=4096, help="tokens per prefill chunk (default 4096)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    # the API's names in errors (a memory check's advice), as this command's flags
    p.set_defaults(run=run, flags={"num_layers": "writescope generate --num-layers", "max_batch": "one sequence",
                                   "max_model_len": "fewer --machine-text tokens or a shorter --prompt-file"})


def run(args: argparse.Namespace) -> int:
    import time

    from writescope import LLM, SamplingParams
    from writescope.cli.bench import parse_tokens
    from writescope.cli.outputs import check_output_file
    from writescope.moe.popularity import ExpertProfile, recording

    check_output_file(args.out, "--out")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        raise ValueError(f"--prompt-file {args.prompt_file}: no such file")
    if args.prefill_chunk_tokens < 1:
        raise ValueError(f"--prefill-chunk-tokens must be >= 1, got {args.prefill_chunk_tokens}")
    from writescope.engine.model_loader import capped_model_len, load_tokenizer

    tok = load_tokenizer(args.model, args.synthetic)  # the model's own (LLM gives the same), read before the build
    if args.prompt_file is None:
        from writescope.engine.machine_text import machine_prompts

        (tokens,) = parse_tokens(args.machine_text, "--machine-text", one=True)
        ids = machine_prompts(tok, tokens, 1)[0][0]
    else:
        ids = tok.encode(args.prompt_file.read_text(encoding="utf-8"))
        if not ids:
            raise ValueError(f"--prompt-file {args.prompt_file}: no tokens")
    llm = LLM(args.model, synthetic=args.synthetic, device=args.device, dtype=args.dtype, progress=not args.quiet,
              policy="resident" if args.vram_budget is None else "gpu", vram_budget=args.vram_budget, max_batch=1,
              max_model_len=capped_model_len(args.model, len(ids) + 1, None, args.synthetic),  # a budget's plan: for what is routed
              prefill_chunk_tokens=args.prefill_chunk_tokens)
    if not llm.config.moe.moe_layers:
        raise ValueError(f"{args.model} has no MoE layers: nothing to profile")
    ids = ids[: llm.max_model_len - 1]
    t0 = time.perf_counter()
    with recording(llm.model) as counts:
        llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
    profile = ExpertProfile(counts, len(ids), args.model)
    profile.save(args.out)
    k = llm.config.moe.num_experts // 4
    shares = [profile.coverage(i, profile.hot(i, k)) for i in sorted(counts)]
    print(f"routed {len(ids):,} tokens through {len(counts)} MoE layers in {time.perf_counter() - t0:.1f} s; the most chosen quarter "
          f"({k}) of a layer's experts takes {min(shares):.1%}-{max(shares):.1%} of its assignments (uniform: 25%)")
    print(f"wrote {args.out}: use it with --expert-profile {args.out}")
    return 0
