"""Per layer step, the CPU and GPU parts of decode attention for policies placing an even or odd
number of compute blocks (Qwen3-30B-A3B shape, 2 layers, batch 16, 16K; needs CUDA).
Run: PYTHONPATH=. python3 benchmarks/scheduler_diag.py  (results: benchmarks/results/scheduler.md)"""
import statistics

import torch

from writescope import LLM, SamplingParams
from writescope.engine.timing import synchronized_seconds
llm = LLM("qwen3-30b-a3b", num_layers=2, progress=False, policy="gpu")
rf = llm.roofline(256)
print(rf)
P, B = 16384, 16
g = torch.Generator().manual_seed(0)
prompts = torch.randint(3, 1000, (B, P), generator=g).tolist()
for pol in ["static:0.3125", "writescope", "static:0.328125", "writescope", "static:0.3125"]:
    llm.set_policy(pol, 256, roofline=rf)
    dec = llm.cache.decoder
    inner = dec.decode
    rec = []
    def wrapped(*a, **k):
        out, dt = synchronized_seconds(lambda: inner(*a, **k), llm.device)
        rec.append((dt, dec.stats.last_cpu_seconds, dec.last_gpu_seconds()))
        if len(rec) == 1:
            sq = a[2][0]
            print("  slabs", [(s.nblk, s.first) for s in sq.slabs], "compute", tuple(sq.compute.shape), sq.compute.stride(), "n_comp", sq.n_comp, "n_load", sq.n_load, "staging", None if sq.staging is None else tuple(sq.staging.shape))
        return out
    dec.decode = wrapped
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=17, ignore_eos=True))

    med = [statistics.median(x[i] for x in rec[4:]) * 1e3 for i in range(3)]
    print(f"{pol:18s} r={outs[0].kv_placement} total {med[0]:.2f} ms cpu {med[1]:.2f} ms gpu {med[2]:.2f} ms; policy {llm.cache.policy!r} max_load {llm.cache.policy.max_load_share}", flush=True)
