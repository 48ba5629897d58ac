"""CPU attention of 16 sequences (Qwen3 KV shape, bf16, 15 threads): the first chunking (n // (n // 512)
keys per chunk plus a tail call per sequence) against the current cpu_attend, by number of 256-token blocks.
Run: PYTHONPATH=. python3 benchmarks/cpu_chunking.py  (results: benchmarks/results/cpu_chunking_h200.log)"""
import time, statistics, torch
import writescope.attention.partial as P
torch.set_num_threads(15)
Hkv, G, dk, B = 4, 8, 128, 16
def old(q, k, v, scale):
    Hkv, n, dk = k.shape
    chunks = max(1, n // 512); c = n // chunks
    qb = q.unsqueeze(0)
    kc = k.as_strided((chunks, Hkv, c, dk), (c * k.stride(1), k.stride(0), k.stride(1), 1), k.storage_offset())
    vc = v.as_strided((chunks, Hkv, c, dk), (c * v.stride(1), v.stride(0), v.stride(1), 1), v.storage_offset())
    o, lse = P._cpu_flash(qb.expand(chunks, -1, -1, -1), kc, vc, scale=scale)[:2]
    if c * chunks < n:
        o2, lse2 = P._cpu_flash(qb, k[None, :, c * chunks:], v[None, :, c * chunks:], scale=scale)[:2]
        o, lse = torch.cat((o, o2)), torch.cat((lse, lse2))
    return o, lse
new_p, new_t = P._cpu_partials, P._cpu_tails
print("blocks of 256 keys per sequence, batch 16, bf16, 15 threads: ms old / new")
for nb in (20, 21, 40, 41, 64, 65, 8, 9):
    n = nb * 256
    regs = [torch.randn(2, Hkv, 32768, dk, dtype=torch.bfloat16) for _ in range(B)]
    kv = [(r[0, :, :n], r[1, :, :n]) for r in regs]
    q = torch.randn(B, Hkv, G, dk, dtype=torch.bfloat16)
    res = []
    for name in ("old", "new"):
        P._cpu_partials, P._cpu_tails = (old, lambda *a: iter(())) if name == "old" else (new_p, new_t)
        ts = []
        for _ in range(14):
            t0 = time.perf_counter(); P.cpu_attend(q, kv, 0.088, dk); ts.append(time.perf_counter() - t0)
        res.append(statistics.median(ts[2:]) * 1e3)
    print(f"  {nb:3d} blocks: {res[0]:6.2f} / {res[1]:6.2f}", flush=True)
P._cpu_partials, P._cpu_tails = new_p, new_t
