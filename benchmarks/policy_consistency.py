"""Same model, same prompts, every placement policy: tokens vs ``resident`` and timings.

    python benchmarks/policy_consistency.py --model deepseek-v2-lite --device cuda \
        --policies resident,gpu,cpu,static:0.5 --batch 4 --max-new-tokens 48 --out results/x.json

The prompt is Python standard-library source read on this machine at run time (``--prompt-module``,
default ``json.decoder`` + ``json.encoder``), truncated to ``--prompt-tokens``. Weights are built
once (synthetic for presets); each policy gets a fresh cache (``LLM.set_policy``).

Two runs per policy:
- free-running greedy: its tokens against the first policy's, and where they first diverge;
- teacher-forced (``--forced``, on by default): fed the first policy's tokens, its logits at every
  step against the first policy's (max |difference|, relative to the logits' range). At each
  free-running divergence the first policy's margin between its top two logits is reported: a
  margin within the logits' difference explains the divergence as rounding.

    python benchmarks/policy_consistency.py --model tiny-qwen3-moe --device cpu --policies resident,gpu,cpu \
        --batch 2 --max-new-tokens 8 --prompt-tokens 600 --out /tmp/consistency.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

import writescope.engine.runner as engine
from writescope import LLM, SamplingParams
from writescope.kvcache.spec import Roofline
from writescope.scheduler.policies import parse_policy


def generate_forced(llm, prompts, params, forced=None):
    """``llm.generate`` with every step's logits kept (float32 on the CPU, ``[steps][batch, vocab]``);
    with ``forced`` (per request its token ids) the sampled tokens are replaced by those."""
    steps, real = [], engine.sample

    def sample(logits, plist, gens):
        k = len(steps)
        steps.append(logits.float().cpu())
        got = real(logits, plist, gens)
        if forced is not None and len(got) != len(forced):  # rows would no longer line up with requests
            raise ValueError("teacher forcing needs every request to run every step: use ignore_eos and one max_tokens")
        return got if forced is None else [f[k] for f in forced]

    engine.sample = sample
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    finally:
        engine.sample = real
    return outs, steps


def compare_logits(steps, ref_steps) -> dict:
    """Max |logit difference| over every step and request, and the reference's logit range."""
    diff = max((s - r).abs().max().item() for s, r in zip(steps, ref_steps))
    span = max((r.max() - r.min()).item() for r in ref_steps)
    return {"max_abs_logit_diff": diff, "ref_logit_range": span, "relative": diff / span if span else 0.0}


def margin(ref_steps, row: int, step: int) -> float:
    """The reference's top-1 minus top-2 logit of request ``row`` at ``step``."""
    top = ref_steps[step][row].topk(2).values
    return (top[0] - top[1]).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3-moe")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--policies", default="resident,gpu,cpu,static:0.5")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-modules", default="json.decoder,json.encoder")
    p.add_argument("--prompt-tokens", type=int, default=None, help="truncate each prompt to this many tokens")
    p.add_argument("--machine-text", type=int, default=None, metavar="TOKENS",
                   help="instead: prompts of TOKENS tokens of this machine's text (writescope generate --machine-text)")
    p.add_argument("--vram-budget", default=None, help="run under a GPU budget, e.g. 32GiB")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-forced", dest="forced", action="store_false", help="skip the teacher-forced logit comparison")
    a = p.parse_args()
    for pol in a.policies.split(","):  # a bad name fails before the weights are built
        parse_policy(pol, roofline=Roofline(1.0, 1.0))
    t0 = time.perf_counter()
    llm = LLM(a.model, device=a.device, dtype=a.dtype, progress=False, vram_budget=a.vram_budget, max_batch=a.batch)
    if a.machine_text is not None:
        from writescope.engine.machine_text import machine_prompts

        if a.machine_text <= a.batch:
            raise SystemExit(f"--machine-text {a.machine_text} must exceed --batch {a.batch} (request i drops its first i tokens)")

        prompts, _ = machine_prompts(llm.tokenizer, a.machine_text, a.batch)
        prompts = [x[i:] for i, x in enumerate(prompts)]  # ragged: request i drops its first i tokens
    else:
        text = "".join(Path(importlib.import_module(m).__file__).read_text() for m in a.prompt_modules.split(","))
        ids = llm.tokenizer.encode(text)[: a.prompt_tokens]
        prompts = [ids[i:] for i in range(a.batch)]  # ragged: request i drops its first i tokens
    window = llm.window  # D: set_policy keeps it
    if max(len(x) for x in prompts) + a.max_new_tokens <= window:
        print(f"warning: every token stays in the {window}-token D-window, so no policy places any KV elsewhere and all "
              f"trivially match: use prompts of more than {window - a.max_new_tokens} tokens", flush=True)
    print(f"{a.model} on {llm.device} ({llm.dtype}), built in {time.perf_counter() - t0:.1f} s; "
          f"prompts {[len(x) for x in prompts]} tokens, {a.max_new_tokens} new")
    params = SamplingParams(max_tokens=a.max_new_tokens, ignore_eos=True)
    rows, ref, ref_steps = [], None, None
    for pol in a.policies.split(","):
        llm.set_policy(pol)
        outs, free_steps = generate_forced(llm, prompts, params)
        toks = [o.token_ids for o in outs]
        ref = ref if ref is not None else toks
        ref_steps = ref_steps if ref_steps is not None else free_steps
        first_diff = [next((j for j, (x, y) in enumerate(zip(t, r)) if x != y), None) for t, r in zip(toks, ref)]
        forced = None
        if a.forced:
            llm.set_policy(pol)  # a fresh cache
            _, forced_steps = generate_forced(llm, prompts, params, forced=ref)
            forced = compare_logits(forced_steps, ref_steps)
            forced["ref_margin_at_divergence"] = [None if j is None else margin(ref_steps, i, j) for i, j in enumerate(first_diff)]
        m = outs[0].metrics
        place = outs[0].kv_placement
        rows.append({"policy": pol, "ttft_s": m.ttft_s, "tpot_ms": sorted(o.metrics.tpot_s for o in outs)[len(outs) // 2] * 1e3,
                     "decode_tok_s": m.decode_tok_s, "prefill_tok_s": m.prefill_tok_s, "same_as_first": toks == ref,
                     "first_divergence": first_diff, "kv_placement_request0": place, "peak_gib": m.peak_memory_bytes / 2**30,
                     "teacher_forced": forced})
        r = rows[-1]
        print(f"{pol:>12}: TTFT {r['ttft_s']:.2f} s  TPOT {r['tpot_ms']:.1f} ms  decode {r['decode_tok_s']:.1f} tok/s  "
              f"same tokens: {r['same_as_first']} (first divergence per request {first_diff})  KV {place}", flush=True)
        if forced:
            marg = ", ".join("-" if x is None else f"{x:.3g}" for x in forced["ref_margin_at_divergence"])
            print(f"{'':>12}  teacher-forced: max |logit diff| {forced['max_abs_logit_diff']:.3g} "
                  f"({100 * forced['relative']:.2f}% of the logit range {forced['ref_logit_range']:.3g}); "
                  f"first policy's top-2 margin where tokens diverged: {marg}", flush=True)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "prompt_lens": [len(x) for x in prompts], "rows": rows}, indent=1))


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a bad policy, size, device or model
        raise SystemExit(f"policy_consistency.py: error: {e}") from None
