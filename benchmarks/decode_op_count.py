"""How many torch calls a short generate makes, and how spread the routing of the synthetic weights
is: the CPU-side check behind run 5 of benchmarks/results/gpu_decode_h200.md (run it at two commits
and compare; the figures do not depend on the machine).

    PYTHONPATH=. python benchmarks/decode_op_count.py

DeepSeek-V2-Lite's shape, 3 layers, bf16 on the CPU, policy gpu, window 64: 4 prompts of 300 tokens
and 9 new tokens each (after one unmeasured run). Prints the aten calls (the profiler's count),
the most frequent ones, and per MoE layer the share of a 2,000-token prompt's assignments that
its 6 most chosen experts take (uniform routing over 64 experts: 6/64 = 9.4%).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from writescope import LLM, SamplingParams
from writescope.moe.popularity import recording


def main() -> None:
    llm = LLM("deepseek-v2-lite", synthetic=True, num_layers=3, dtype="bf16", progress=False, policy="gpu", window=64, max_model_len=4096)
    prompts = [[(7 * i + 3) % 1000 + 5 for i in range(300)] for _ in range(4)]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=9, ignore_eos=True))
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    print("aten calls", sum(e.count for e in ops))
    for e in sorted(ops, key=lambda e: -e.count)[:10]:
        print(f"  {e.key} {e.count}")
    with recording(llm.model) as counts:
        llm.generate(prompt_token_ids=[[(7 * i + 3) % 5000 + 5 for i in range(2000)]], sampling_params=SamplingParams(max_tokens=1))
    for layer, row in counts.items():
        top = sorted(row, reverse=True)[:6]
        print(f"layer {layer}: the 6 most chosen experts take {sum(top) / sum(row):.1%} of the assignments")


if __name__ == "__main__":
    main()
