"""``writescope generate``: prompts in, text and timings out."""

from __future__ import annotations

import argparse
import os
import json
from pathlib import Path

from writescope.cli.experts import add_expert_profile_flag, add_stream_share_flag, check_stream_share, stream_share_note
from writescope.cli.outputs import check_output_file
from writescope.errors import plural


STREAM_HEADER = "--- request 0, streamed as it is decoded:"  # the streamed text follows this line (not with --quiet)


def core_plan(llm) -> str:
    """The CPU's work in a decode step, in words: who attends the compute region (the native
    worker's or the thread pool's threads, and the kernel's path), who computes host experts, and
    the thread that issues the GPU work (docs/DESIGN.md section 10)."""

    from writescope.attention.split import _native_wanted

    worker = "the native C++ worker" if _native_wanted() and "C++ kernel" in llm.cpu_attention else "a Python thread pool"
    issue = "the main thread issues the GPU work and samples" if llm.device.type == "cuda" else "the main thread runs the 'GPU' side too"
    hosted = [b for b in llm._moe_blocks if b.host_experts]
    if not hosted:
        experts = "none in host memory"
    else:
        how = "C++ kernel" if hosted[0].uses_host_kernel(llm.dtype) else "torch's GEMMs"
        handle = getattr(llm, "expert_worker", None)
        on_worker = handle is not None and all(getattr(b, "takes_async", lambda *a: False)(llm.dtype, llm.device, llm.max_batch) for b in hosted)
        from writescope.native.team import team_wanted

        team = "one thread and OpenMP team with the attention worker" if team_wanted() and worker.startswith("the native") else "a thread of its own"
        threads, where = (handle.threads, f"on the native expert worker ({team}), ") if on_worker else (llm.expert_threads, "on the issuing thread, ")
        experts = (f"{threads} threads for the host experts the CPU computes ({where}{how}, "
                   f"WRITESCOPE_EXPERT_ISA={os.environ.get('WRITESCOPE_EXPERT_ISA', 'auto')})")
    return (f"CPU threads: attention {llm.attention_threads} ({worker}, {llm.cpu_attention}); experts: {experts}; {issue} "
            "(--cpu-threads, --expert-threads)")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text and print timings")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name (presets use synthetic weights)")
    p.add_argument("--synthetic", action="store_true", help="seeded synthetic weights instead of the checkpoint's")
    p.add_argument("--num-layers", type=int, default=None,
                   help="keep only the first N decoder layers of the model's shape (synthetic weights: a large model on a small machine)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", type=Path, help="file whose text is the prompt")
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--machine-text", metavar="TOKENS",
                     help="prompts of TOKENS tokens (k = 1024) of real text read from this machine (Python's license and "
                          "standard-library docstrings); request i starts 997 i tokens further in")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per request (default 32)")
    p.add_argument("--batch", type=int, default=1, help="requests in the batch (default 1): copies of the prompt, or with --machine-text each its own stretch of text")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: sample from the smallest set of tokens whose probabilities sum to P, in (0, 1] "
                        "(default 1: all tokens; only with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; request i of the batch uses seed + i (default 0)")
    p.add_argument("--weight-seed", type=int, default=0, help="seed of the synthetic weights (default 0)")
    p.add_argument("--device", default="auto", help="auto (cuda when present, the default), cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + new tokens per request")
    p.add_argument("--prefill-chunk-tokens", type=int, default=8192,
                   help="prompt tokens per prefill forward pass (default 8192; fewer bound activation memory under --vram-budget)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--policy", default="resident",
                   help="KV placement: resident (all on the device), gpu (stream spilled KV), cpu (attend it on the CPU), "
                        "static:R (CPU share R in [0,1]), writescope (roofline share with online feedback; calibrates "
                        "once per machine), monolithic[:R] (the one-state baseline); default resident (nothing measured first; plan and profile default to writescope)")
    p.add_argument("--window", type=int, default=256, help="D: tokens of the D-window and of one KV block (default 256)")
    p.add_argument("--cpu-threads", type=int, default=None, help="threads for CPU attention, 1 to the CPUs this process may use (default: WRITESCOPE_CPU_THREADS when set, else all torch threads, less one with CUDA)")
    p.add_argument("--expert-threads", type=int, default=None, help="threads for routed experts in host memory, 1 to the CPUs this process may use (default: all torch threads)")
    p.add_argument("--vram-budget", default=None, help="device memory the run may use, e.g. 32GiB or 32G (2^30 bytes a GiB; 32GB is 32 x 10^9 bytes); routed experts beyond it go to the CPU")
    add_stream_share_flag(p)
    add_expert_profile_flag(p)
    p.add_argument("--output-json", type=Path, help="write token ids, text and metrics per request here")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars and no streamed text: each request's text is printed once it is finished "
                        "(without --quiet a single request's text is printed as it is decoded, and a batch shows a bar "
                        "of the tokens generated with tok/s)")
    p.set_defaults(run=run, flags={"max_tokens": "--max-new-tokens", "max_batch": "--batch", "seed": "--weight-seed",
                                   "kv_tokens": "--batch, --max-new-tokens or a shorter prompt",
                                   "sampling_params": "--batch"})


def _prompt(args) -> tuple[list[str] | None, list[list[int]] | None]:
    if args.machine_text is not None:
        return None, None  # built once the tokenizer is loaded
    if args.prompt_ids is not None:
        items = [t.strip() for t in args.prompt_ids.split(",")] if args.prompt_ids.strip() else []
        if "" in items:
            raise ValueError(f"--prompt-ids {args.prompt_ids!r} has an empty entry: give comma-separated integers, e.g. 1,2,3")
        try:
            ids = [int(t) for t in items]
        except ValueError as e:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from e
        return None, [ids] * args.batch
    if args.prompt_file is not None:
        if not args.prompt_file.exists():
            raise FileNotFoundError(f"--prompt-file {args.prompt_file} does not exist")
        if not args.prompt_file.is_file():
            raise ValueError(f"--prompt-file {args.prompt_file} is not a regular file: give a text file")
        text = args.prompt_file.read_text(errors="replace")
    else:
        text = args.prompt
    return [text] * args.batch, None


def budget_line(llm) -> str:
    """The line that says a ``--vram-budget`` run's plan (``llm.vram_plan``, not None): the budget
    and where the routed experts live; on the CPU, that the split only shows where they would."""
    where = "" if llm.device.type == "cuda" else " (the device is the CPU here: the split only shows where they would live)"
    return f"{llm.vram_plan.placement_line()}{where} ({llm.host_experts_in_decode()}; see `writescope plan`)"


def run(args: argparse.Namespace) -> int:
    from writescope import LLM, SamplingParams
    from writescope.engine.threads import BUSY_REMEDY, busy_note

    busy = busy_note()  # before this run's own threads add to the load average (where the run cannot be measured)

    source = next(f for f in ("--prompt-file", "--prompt", "--prompt-ids", "--machine-text")
                  if getattr(args, f[2:].replace("-", "_")) is not None)
    args.flags = {**args.flags, "prompts": source, "prompt_token_ids": source}  # API errors name the flag used

    for flag, value in (("--batch", args.batch), ("--max-new-tokens", args.max_new_tokens), ("--window", args.window),
                        ("--cpu-threads", args.cpu_threads), ("--expert-threads", args.expert_threads)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_stream_share(args)
    if 0 < args.top_p < 1 and args.temperature == 0:  # (a top-p outside (0, 1] gets SamplingParams's range message)
        raise ValueError(f"--top-p {args.top_p} samples, but --temperature 0 decodes greedily: give a --temperature above 0 "
                         "too, or leave --top-p out")
    check_output_file(args.output_json, "--output-json")  # before the model loads, not after the run
    params = [
        SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed + i,
                       ignore_eos=args.ignore_eos)
        for i in range(args.batch)
    ]
    prompts, prompt_ids = _prompt(args)
    machine_tokens = None
    if args.machine_text is not None:
        from writescope.cli.bench import parse_tokens

        (machine_tokens,) = parse_tokens(args.machine_text, "--machine-text", one=True)
    elif (prompts is not None and not prompts[0]) or (prompt_ids is not None and not prompt_ids[0]):
        raise ValueError("the prompt is empty: give at least one token (--prompt, --prompt-file or --prompt-ids)")
    max_model_len = args.max_model_len
    if max_model_len is None and args.vram_budget is not None:  # plan for the known prompt, not the model's limit
        known = machine_tokens if machine_tokens is not None else (len(prompt_ids[0]) if prompt_ids is not None else None)
        if known is not None:
            from writescope.engine.model_loader import capped_model_len

            max_model_len = capped_model_len(args.model, known + args.max_new_tokens, args.num_layers, args.synthetic)
            args.flags = {**args.flags, "max_model_len": "--max-new-tokens (or a shorter prompt)"}  # what sets it here
    if machine_tokens is not None or prompt_ids is not None:
        prompt_tokens = machine_tokens if machine_tokens is not None else len(prompt_ids[0])
    else:  # counted with the model's tokenizer (read without building the model)
        from writescope.engine.model_loader import load_tokenizer

        prompt_tokens = len(load_tokenizer(args.model, args.synthetic).encode(prompts[0]))
    from writescope.engine.model_loader import resolve_config
    from writescope.engine.prompts import check_token_ids, too_long

    cfg = resolve_config(args.model, args.num_layers, args.synthetic)[0]  # the preset's or the checkpoint's config.json
    if prompt_ids is not None:  # the engine's checks, in its order, before the kernels build and the weights load
        check_token_ids(prompt_ids, cfg.vocab_size, "prompt_token_ids")
    model_limit = cfg.max_position_embeddings
    limit = args.max_model_len or model_limit
    if prompt_tokens + args.max_new_tokens > limit:  # the engine's check, before the kernels build and the weights load
        raise too_long("prompts", 0, prompt_tokens, args.max_new_tokens, limit, model_limit,
                       "--machine-text" if machine_tokens is not None else None)
    llm = LLM(
        args.model, synthetic=args.synthetic, device=args.device, dtype=args.dtype, seed=args.weight_seed,
        kv_tokens=args.batch * (prompt_tokens + args.max_new_tokens),  # the memory check before the build counts their KV
        max_model_len=max_model_len, prefill_chunk_tokens=args.prefill_chunk_tokens, progress=not args.quiet, policy=args.policy, window=args.window,
        cpu_threads=args.cpu_threads, vram_budget=args.vram_budget, max_batch=args.batch, expert_threads=args.expert_threads,
        num_layers=args.num_layers,
        expert_stream_share=args.expert_stream_share, expert_profile=args.expert_profile,
    )
    cfg = llm.config
    if llm.vram_plan is not None:
        p = llm.vram_plan
        print(budget_line(llm))
        held = llm.load_info.get("device_memory_at_cap")
        if held:
            print(f"device memory when the cap was set: {held['allocated'] / 2**30:.2f} GiB in tensors, "
                  f"{held['reserved'] / 2**30:.2f} GiB held (plan: {p.weights_gpu / 2**30:.2f} GiB of weights)")
    print(f"model: {cfg.architecture} ({plural(cfg.num_layers, 'layer')}, {cfg.moe.num_experts} experts, top-{cfg.moe.top_k}), "
          f"{llm.load_info['source']}, {llm.dtype} on {llm.device}, loaded in {llm.load_info['load_s']:.1f} s; "
          f"experts: {'grouped GEMMs' if llm.load_info.get('grouped_experts') else 'one GEMM chain per expert (no grouped GEMM here)'}")
    if (note := stream_share_note(args.expert_stream_share, llm)) is not None:
        print(note, flush=True)
    print(core_plan(llm))
    if llm.policy is not None and llm.device.type == "cpu":
        print(f"note: policy {llm.policy_name} on the CPU: the 'GPU' side runs as CPU tensors (exact, but no device split)")
    if machine_tokens is not None:
        from writescope.engine.machine_text import machine_prompts

        prompt_ids, have = machine_prompts(llm.tokenizer, machine_tokens, args.batch)
        print(f"prompts: {args.batch} x {machine_tokens} tokens of this machine's text (Python's license and docstrings; "
              f"read from {have:,} tokens of text{', repeated where they run out' if have < machine_tokens + (args.batch - 1) * 997 else ''})")
    from writescope.engine.streaming import BatchProgress, TextStreamer

    stream = None  # a single request's text printed as it is decoded; a batch's progress bar (stderr)
    if not args.quiet:
        stream = (TextStreamer(llm.tokenizer.decode, header=f"\n{STREAM_HEADER}") if args.batch == 1
                  else BatchProgress([sp.max_tokens for sp in params]))
    from writescope.engine.cpu_competition import CpuCompetition

    competition = CpuCompetition()  # what other processes take of this process's CPUs while the run is timed
    try:
        outs = llm.generate(prompts, params, prompt_token_ids=prompt_ids, on_tokens=stream)
    finally:
        if isinstance(stream, BatchProgress):
            stream.close()
    for o in outs:
        print(f"\n--- request {o.request_id}: {plural(o.metrics.prompt_tokens, 'prompt token')} -> {o.metrics.output_tokens} new "
              f"({o.finish_reason})" + ("; text streamed above" if args.batch == 1 and not args.quiet else ""))
        if args.batch != 1 or args.quiet:
            print(o.text)
    readback = llm.cache.prefill_readback() if hasattr(llm.cache, "prefill_readback") else None
    allocation = llm.cache.kv_allocation() if hasattr(llm.cache, "kv_allocation") else None
    print("\n" + format_timings(outs, llm.policy_name, llm.cpu_attention, llm.decode_host, readback, allocation, llm.prefill_chunks))
    busy = competition.note_or(busy, BUSY_REMEDY)
    if busy is not None:
        print(busy)
    if llm.r_trace:
        print(format_r_trace(llm.r_trace))
    if args.output_json:
        doc = {"model": args.model, "device": str(llm.device), "dtype": str(llm.dtype), "policy": llm.policy_name,
               "r_trace": llm.r_trace, "decode_host_s": [list(x) for x in llm.decode_host], "prefill_readback": readback,
               "kv_allocation": allocation, "prefill_chunks": llm.prefill_chunks, "decode_between_s": list(llm.decode_between), "requests": [o.to_dict() for o in outs]}
        args.output_json.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.output_json}")
    return 0


def format_r_trace(trace: list[dict], lines: int = 8) -> str:
    """The CPU share over the decode: target r(L) of the policy and the share placed, at most
    ``lines`` evenly spaced points (all of them are in --output-json)."""
    pick = trace if len(trace) <= lines else [trace[round(i * (len(trace) - 1) / (lines - 1))] for i in range(lines)]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    def experts(p):  # the joint roofline's split of the host experts in that step (all layers)
        return f"  host experts streamed {p['experts_streamed']}, on the CPU {p['experts_cpu']}" if "experts_streamed" in p else ""

    rows = [f"  step {p['step']:>5}  L {p['L']:>10,.0f}  target r(L) {f(p['target'])}  placed {f(p['deployed'])}{experts(p)}" for p in pick]
    return ("r(L) trace (mean placed tokens per sequence L; target: the CPU share new blocks are placed at now; placed: the share "
            "of the placed tokens in the compute region, where each block stays from its placement on, so it can differ from "
            "today's target)\n" + "\n".join(rows))


def format_timings(outs, policy: str = "resident", cpu_attention: str | None = None, decode_host=None, readback=None,
                   allocation=None, chunks=None) -> str:
    """The timings table; ``decode_host``: the main thread's (issue, wait) seconds per decode step
    (:class:`~writescope.engine.runner.EngineCore`), shown as medians. Issuing includes any host
    wait inside the step (host experts read their routing back); without one, a step whose wait
    is near 0 was bound by the thread issuing it, not by the device. ``readback``: chunked
    prefill's read-back (``InplaceKVCache.prefill_readback``), shown where anything was read.
    ``allocation``: the KV allocation's up-front host work (``InplaceKVCache.kv_allocation``),
    shown where a sequence was allocated. ``chunks``: the prefill's forward passes, or groups of
    them run layer by layer (``LLM.prefill_chunks``), shown where there were two or more: the
    first's seconds against the median and the slowest of the others."""
    m = outs[0].metrics
    tpots = sorted(o.metrics.tpot_s for o in outs)
    rows = [
        ("batch", f"{len(outs)}"),
        ("prompt tokens (total)", f"{sum(o.metrics.prompt_tokens for o in outs):,}"),
        ("prefill", f"{m.prefill_tok_s:,.0f} tok/s"),
        ("TTFT", f"{m.ttft_s * 1e3:,.1f} ms"),
        ("TPOT (median over requests of each one's mean)" if len(outs) > 1 else "TPOT (mean)", f"{tpots[len(tpots) // 2] * 1e3:,.2f} ms"),
        ("decode", f"{m.decode_tok_s:,.1f} tok/s"),
        ("peak memory", f"{m.peak_memory_bytes / 2**30:,.2f} GiB"),
        ("KV policy", policy),
    ]
    if decode_host:
        issue, wait = (sorted(x[i] for x in decode_host)[len(decode_host) // 2] * 1e3 for i in (0, 1))
        rows.insert(6, ("decode step, main thread (median)", f"issuing {issue:,.2f} ms, then waiting {wait:,.2f} ms"))

    def size(b):
        return f"{b / 1e9:,.1f} GB" if b >= 1e9 else f"{b / 1e6:,.1f} MB"

    def secs(t):
        return f"{t:,.1f} s" if t >= 1 else f"{t * 1e3:,.1f} ms"

    prefill_rows = []  # after TTFT, in this order
    if readback and readback.get("kept_bytes"):
        prefill_rows.append(("prefill KV kept on the device (passes layer by layer)",
                             f"{size(readback['kept_bytes'])} of earlier KV not read back"))
    if readback and readback["bytes"]:
        taken = f" ({secs(readback['take_wait_s'])} waiting for reads started ahead)" if readback.get("take_wait_s") else ""
        parts = [f"{secs(readback['staging_copy_s'])} copying compute rows to pinned staging"] if readback["staging_copy_s"] else []
        if readback.get("wait_s"):
            parts.append(f"{secs(readback['wait_s'])} waiting for earlier writes and staging buffers")
        prefill_rows.append(("prefill read-back (chunks re-reading earlier KV)",
                             f"{size(readback['bytes'])} ({size(readback['compute_bytes'])} compute rows); "
                             f"issuing thread {secs(readback['host_s'])} in it{taken}"
                             + (f"; compute-row reads (reader and issuing threads): {', '.join(parts)}" if parts else "")))
    if allocation and allocation["sequences"]:
        prefill_rows.append(("KV allocation (before the timed prefill)",
                             f"{plural(allocation['sequences'], 'sequence')} in {secs(allocation['host_s'])}: "
                             f"{size(allocation['reserve_bytes'])} of load blocks reserved in {secs(allocation['reserve_s'])}, "
                             f"{size(allocation['commit_bytes'])} of compute rows committed in {secs(allocation['commit_s'])}"))
    if chunks and len(chunks) > 1:
        took = [c["end_s"] - (chunks[k - 1]["end_s"] if k else 0.0) for k, c in enumerate(chunks)]
        rest = sorted(took[1:])
        slow = max(range(1, len(took)), key=took.__getitem__)
        grouped = any(c.get("passes", 1) > 1 for c in chunks)  # groups of passes run layer by layer (engine/prefill_order.py)
        prefill_rows.append(("prefill groups of passes, layer by layer (issuing thread, each)" if grouped else
                             "prefill passes (issuing thread, each)",
                             f"{len(took)} of up to {max(c['tokens'] for c in chunks):,} tokens: the first {secs(took[0])}, "
                             f"the others median {secs(rest[len(rest) // 2])}, slowest {secs(took[slow])} ({'group' if grouped else 'pass'} {slow + 1})"))
    rows[4:4] = prefill_rows
    if cpu_attention is not None and policy not in ("resident", "gpu"):  # only these never attend on the CPU
        rows.append(("CPU attention", cpu_attention))
    from writescope.engine.switches import NAMES  # the runtime's switches only (never e.g. WRITESCOPE_API_KEY)

    switches = sorted(f"{k}={os.environ[k]}" for k in NAMES if k in os.environ)
    if switches:  # what the run was steered by (benchmark logs then say it)
        rows.append(("switches (environment)", ", ".join(switches)))
    if outs[0].kv_placement is not None:
        tot = {k: sum(o.kv_placement[k] for o in outs) for k in outs[0].kv_placement}
        n = max(1, sum(tot.values()))
        rows.append(("KV tokens at end", ", ".join(f"{k} {v:,} ({100 * v / n:.1f}%)" for k, v in tot.items())))
    w = max(len(k) for k, _ in rows)
    return "timings\n" + "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)
