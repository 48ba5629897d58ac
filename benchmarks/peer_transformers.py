"""A peer in the same run: Hugging Face transformers generating from the same checkpoint with its
offloaded KV cache, against writescope, decode tok/s side by side (issue: end to end, run 5).

transformers keeps every weight on the GPU (no budget) and moves each layer's KV between host and
device as it goes (``cache_implementation="offloaded"``); writescope runs with the given policies.
Both get the same random prompts (batch x context tokens) and generate --new-tokens greedily.
Decode tok/s of transformers = batch (N - 1) / (time of N new tokens - time of 1 new token).

Run (repository root; the checkpoint from ``writescope make-checkpoint --preset deepseek-v2-lite``):
    PYTHONPATH=. python3 benchmarks/peer_transformers.py --checkpoint /data/dsv2 --contexts 8k,32k --batch 4 \\
        --out benchmarks/results/peer_transformers_h200
    PYTHONPATH=. python3 benchmarks/peer_transformers.py --checkpoint /tmp/tiny --device cpu --hf-cache dynamic \\
        --contexts 300 --batch 2 --new-tokens 4 --out /tmp/peer
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from writescope import LLM, SamplingParams
from writescope.cli.bench import parse_tokens
from writescope.engine.model_loader import parse_dtype, resolve_device
from writescope.engine.timing import synchronized_seconds


def hf_generate_seconds(model, input_ids, new_tokens, cache, device) -> float:
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if cache != "dynamic":
        kw["cache_implementation"] = cache
    with torch.no_grad():
        return synchronized_seconds(lambda: model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kw), device)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--contexts", default="8k,32k")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--policies", default="writescope,gpu", help="writescope policies to run")
    ap.add_argument("--hf-cache", default="offloaded", help="transformers cache_implementation (offloaded, dynamic, ...)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    contexts = parse_tokens(args.contexts)
    rows = []
    llm = LLM(str(args.checkpoint), device=str(device), dtype=dtype, progress=False, max_batch=args.batch)
    vocab = llm.config.vocab_size
    prompts = {c: torch.randint(3, vocab, (args.batch, c), generator=torch.Generator().manual_seed(c)) for c in contexts}
    for c in contexts:
        for pol in args.policies.split(","):
            llm.set_policy(pol)
            try:
                outs = llm.generate(prompt_token_ids=prompts[c].tolist(),
                                    sampling_params=SamplingParams(max_tokens=args.new_tokens, ignore_eos=True))
                m = outs[0].metrics
                rows.append({"engine": f"writescope ({pol})", "context": c, "batch": args.batch, "decode_tok_s": m.decode_tok_s,
                             "prefill_tok_s": m.prefill_tok_s, "tpot_ms": m.tpot_s * 1e3})
            except (ValueError, RuntimeError, torch.OutOfMemoryError) as e:
                rows.append({"engine": f"writescope ({pol})", "context": c, "batch": args.batch, "error": str(e)[:200]})
            print(json.dumps(rows[-1]), flush=True)
    llm.set_policy("resident")
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(device)  # no accelerate needed
    model.eval()
    for c in contexts:
        ids = prompts[c].to(device)
        try:
            t1 = hf_generate_seconds(model, ids, 1, args.hf_cache, device)
            tn = hf_generate_seconds(model, ids, args.new_tokens, args.hf_cache, device)
            dec = args.batch * (args.new_tokens - 1) / (tn - t1) if tn > t1 else float("nan")
            rows.append({"engine": f"transformers ({args.hf_cache} cache)", "context": c, "batch": args.batch,
                         "decode_tok_s": dec, "prefill_tok_s": args.batch * c / t1, "tpot_ms": (tn - t1) / (args.new_tokens - 1) * 1e3})
        except (ValueError, RuntimeError, torch.OutOfMemoryError) as e:
            rows.append({"engine": f"transformers ({args.hf_cache} cache)", "context": c, "batch": args.batch, "error": str(e)[:200]})
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"checkpoint": str(args.checkpoint), "device": str(device), "dtype": str(dtype),
                                                         "new_tokens": args.new_tokens, "rows": rows}, indent=1))
    lines = ["| engine | context | batch | decode tok/s | TPOT ms | prefill tok/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['context']} | {r['batch']} | failed: {r['error']} | | |")
        else:
            lines.append(f"| {r['engine']} | {r['context']} | {r['batch']} | {r['decode_tok_s']:.1f} | {r['tpot_ms']:.1f} | {r['prefill_tok_s']:,.0f} |")
    table = "\n".join(lines)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
