"""cpu_attend split into its parts (whole-chunk op calls, batched tail call) for 16 sequences of
20/21/40/41 blocks (Qwen3 KV shape, bf16, 15 threads); the rest of cpu_attend is assembly and merge.
Run: PYTHONPATH=. python3 benchmarks/cpu_attend_parts.py  (results: benchmarks/results/scheduler.md)"""
import time, statistics, torch
import writescope.attention.partial as P
torch.set_num_threads(15)
Hkv, G, dk, B = 4, 8, 128, 16
regs = [torch.randn(2, Hkv, 32768, dk, dtype=torch.bfloat16) for _ in range(B)]
q = torch.randn(B, Hkv, G, dk, dtype=torch.bfloat16)
def med(f, n=25):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts[3:]) * 1e3
for nb in (40, 41, 40, 41, 20, 21):
    n = nb * 256
    kv = [(r[0, :, :n], r[1, :, :n]) for r in regs]
    chunks = lambda: [P._cpu_partials(q[i], *kv[i], 0.088) for i in range(B)]
    tails = lambda: list(P._cpu_tails(q, kv, 0.088))
    per_seq_tail = lambda: [P._cpu_flash(q[i:i+1], kv[i][0][None, :, (n // 512) * 512:], kv[i][1][None, :, (n // 512) * 512:], scale=0.088) for i in range(B)] if n % 512 else None
    full = lambda: P.cpu_attend(q, kv, 0.088, dk)
    print(f"{nb} blocks: whole chunks {med(chunks):.2f} ms, batched tails {med(tails):.2f}, per-seq tails {med(per_seq_tail):.2f}, cpu_attend {med(full):.2f}", flush=True)
