"""CPU attention of a decode batch over the compute region: torch's flash op (one call per
sequence) vs the C++ kernel (one call for the batch; its AVX-512 path where built, and its plain
loops), by number of 256-token blocks per sequence. Qwen3-30B-A3B KV shape (4 KV heads, 8 query
heads each, head_dim 128) or MLA (1 x 16, 576/512), bf16, random values.

Per backend: median ms over --repeats calls (the first two are warm-up), GB/s of K and V read
(MLA: the latent once), that rate as a fraction of --read-gbs, and GFLOP/s of the two products.
First, for scale, the rate of an fp32 GEMM that fits in cache (torch.mm, 256 x dk x 512) at the
same threads: roughly what this CPU's multiply-adds allow.

Run: PYTHONPATH=. python3 benchmarks/cpu_kernel_vs_flash.py [--shape mla] [--threads 15] [--read-gbs 86]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from writescope.attention import cpu_kernel
from writescope.attention.partial import cpu_attend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="gqa", choices=["gqa", "mla"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--blocks", default="8,9,20,21,40,41,64,128")
    ap.add_argument("--threads", type=int, default=max(1, torch.get_num_threads() - 1))
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--read-gbs", type=float, default=86.0, help="the machine's CPU read GB/s at these threads (86: the H200 host, 16 threads, HARDWARE.md)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    Hkv, G, dk, dv = (4, 8, 128, 128) if a.shape == "gqa" else (1, 16, 576, 512)
    assert cpu_kernel.kernel_available(), "the kernel did not build"
    fast = "kernel (AVX-512)" if cpu_kernel.avx512_built() else "kernel (no AVX-512 build)"
    x, y = torch.randn(256, dk), torch.randn(dk, 512)
    ts = []
    for _ in range(20):
        t0 = time.perf_counter()
        torch.mm(x, y)
        ts.append(time.perf_counter() - t0)
    print(f"{a.shape}: in-cache fp32 GEMM 256 x {dk} x 512: {2 * 256 * dk * 512 / statistics.median(ts[5:]) / 1e9:.0f} GFLOP/s")
    print(f"{a.shape}: batch {a.batch}, {a.threads} threads, bf16; ms (GB/s of K+V read, fraction of {a.read_gbs:g} GB/s, GFLOP/s)")
    for nb in map(int, a.blocks.split(",")):
        n = nb * 256
        regs = [torch.randn(2 if a.shape == "gqa" else 1, Hkv, n + 256, dk, dtype=torch.bfloat16) for _ in range(a.batch)]
        kv = [(r[0, :, :n], r[1, :, :n]) if a.shape == "gqa" else (r[0, :, :n], r[0, :, :n, :dv]) for r in regs]
        q = torch.randn(a.batch, Hkv, G, dk, dtype=torch.bfloat16)
        nbytes = a.batch * Hkv * n * (dk + (dv if a.shape == "gqa" else 0)) * 2
        flops = 2 * a.batch * Hkv * G * n * (dk + dv)
        res = []
        for backend, name, portable in (("flash", "flash", False), ("kernel", fast, False), ("kernel", "kernel (portable)", True)):
            os.environ["WRITESCOPE_CPU_ATTENTION"] = backend
            cpu_kernel.PORTABLE = portable
            ts = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                cpu_attend(q, kv, dk**-0.5, dv)
                ts.append(time.perf_counter() - t0)
            med = statistics.median(ts[2:])
            res.append(f"{name} {med * 1e3:7.2f} ({nbytes / med / 1e9:5.1f}, {nbytes / med / 1e9 / a.read_gbs:4.0%}, {flops / med / 1e9:5.0f})")
        print(f"  {nb:4d} blocks: " + "   ".join(res), flush=True)


if __name__ == "__main__":
    main()
