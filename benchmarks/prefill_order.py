"""Chunked prefill in both orders side by side, in one process: pass after pass (``chunk``) and
layer by layer over groups of passes (``layer``, engine/prefill_order.py), under each policy.

    PYTHONPATH=. python3 benchmarks/prefill_order.py --model deepseek-v2-lite --synthetic --device cuda \\
        --vram-budget 32GiB --batch 4 --context 32k --policies gpu,writescope --rounds 3 --out benchmarks/results/prefill_order_h200

One model load; per round, every (policy, order) in a rotated order (no row always first), each a
fresh prefill of the same machine-text prompts into a fresh cache (slots allocated before the
clock starts, freed after): seconds from a synchronised start until the prompts' logits are
computed, the KV writes to host memory included (the host's background writes flushed). Round 0
compiles and is not reported. The plan is made for the layer order (it holds more device memory).
Reported per row: median prefill tok/s over the rounds with [min-max], the KV read back from host
memory and the KV a pass took from the device instead (GB per prefill), the issuing thread's
seconds in the read-back; then each policy's layer-over-chunk speedup and each order's
``writescope``-over-``gpu`` ratio (issue 15: routing within 1% of one region).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from writescope import LLM
from writescope.bench.runner import policy_turn
from writescope.cli.bench import parse_tokens
from writescope.engine.machine_text import machine_prompts
from writescope.engine.timing import synchronize

ORDERS = ("chunk", "layer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3-moe")
    p.add_argument("--synthetic", action="store_true", help="seeded synthetic weights for a preset")
    p.add_argument("--device", default="auto")
    p.add_argument("--vram-budget", default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", default="8k", help="prompt tokens per sequence, e.g. 32k")
    p.add_argument("--prefill-chunk-tokens", type=int, default=2048)
    p.add_argument("--policies", default="gpu,writescope", help="comma-separated partitioned policies")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed round)")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    try:
        (args.context,) = parse_tokens(args.context, "--context", one=True)
    except ValueError as e:
        p.error(str(e))
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    if args.batch < 1 or args.rounds < 1 or not args.policies:
        p.error(f"--batch and --rounds must be >= 1 and --policies non-empty (got {args.batch}, {args.rounds}, {args.policies})")
    if "resident" in args.policies:
        p.error("resident reads nothing back and runs its passes one at a time: name partitioned policies")
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out {args.out}: its directory does not exist")
    return args


def one_prefill(llm: LLM, prompts: list[list[int]]) -> dict:
    """Seconds of one prefill of ``prompts`` into fresh slots, and the read-back's deltas."""
    cache = llm.cache
    before = cache.prefill_readback()
    slots = [cache.allocate(len(p) + 1, prompt_len=len(p)) for p in prompts]
    try:
        synchronize(llm.device)
        t0 = time.perf_counter()
        llm._prefill(prompts, slots)
        cache.flush_writes()
        synchronize(llm.device)
        secs = time.perf_counter() - t0
    finally:
        for s in slots:
            cache.free(s)
    after = cache.prefill_readback()
    return {"s": secs, "tok_s": sum(map(len, prompts)) / secs,
            **{k: after[k] - before[k] for k in ("bytes", "kept_bytes", "host_s")}}


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    llm = LLM(args.model, synthetic=args.synthetic, device=args.device, vram_budget=args.vram_budget, max_batch=args.batch,
              max_model_len=args.context + 1, prefill_chunk_tokens=args.prefill_chunk_tokens, policy=args.policies[0],
              window=args.window, prefill_order="layer", progress=False)
    prompts, _ = machine_prompts(llm.tokenizer, args.context, args.batch)
    print(f"{args.model}: loaded in {time.perf_counter() - t0:.1f} s on {llm.device}; {args.batch} x {args.context:,} tokens "
          f"in passes of {args.prefill_chunk_tokens:,}", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds + 1):
        for pol in policy_turn(args.policies, r):
            llm.set_policy(pol)
            for order in policy_turn(list(ORDERS), r):
                llm.prefill_order = order  # the plan counted the layer order's memory: both fit
                row = one_prefill(llm, prompts)
                if r:
                    runs.setdefault((pol, order), []).append(row)
                print(f"round {r}{' (untimed)' if not r else ''}: {pol:<12} {order:<6} {row['tok_s']:>10,.0f} tok/s", flush=True)
    table = []
    for (pol, order), rows in runs.items():
        tok = sorted(x["tok_s"] for x in rows)
        table.append({"policy": pol, "order": order, "tok_s_median": statistics.median(tok), "tok_s_min": tok[0], "tok_s_max": tok[-1],
                      "readback_gb": rows[0]["bytes"] / 1e9, "kept_gb": rows[0]["kept_bytes"] / 1e9,
                      "readback_host_s": statistics.median(x["host_s"] for x in rows), "runs": rows})
    by = {(t["policy"], t["order"]): t for t in table}
    lines = [f"Prefill of {args.batch} x {args.context:,} tokens ({args.model}, passes of {args.prefill_chunk_tokens:,}, "
             f"{llm.device}): median of {args.rounds} rounds [min-max]", "",
             "| policy | order | prefill tok/s | read back (GB) | kept on the device (GB) | issuing thread in read-back (s) |",
             "|---|---|---|---|---|---|"]
    for t in sorted(table, key=lambda t: (t["policy"], t["order"])):
        lines.append(f"| `{t['policy']}` | {t['order']} | {t['tok_s_median']:,.0f} [{t['tok_s_min']:,.0f}-{t['tok_s_max']:,.0f}] | "
                     f"{t['readback_gb']:.3f} | {t['kept_gb']:.3f} | {t['readback_host_s']:.2f} |")
    lines.append("")
    for pol in args.policies:
        lines.append(f"- `{pol}`: layer over chunk {by[(pol, 'layer')]['tok_s_median'] / by[(pol, 'chunk')]['tok_s_median']:.3f}x")
    if {"gpu", "writescope"} <= set(args.policies):
        for order in ORDERS:
            ratio = by[("gpu", order)]["tok_s_median"] / by[("writescope", order)]["tok_s_median"]
            lines.append(f"- {order} order: `gpu` over `writescope` {ratio:.3f}x (issue 15: within 1.01x)")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out is not None:
        args.out.with_suffix(".md").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
