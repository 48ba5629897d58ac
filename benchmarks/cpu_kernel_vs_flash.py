"""CPU attention of a decode batch over the compute region: torch's flash op (one call per
sequence) vs the C++ kernel (one call for the batch), by number of 256-token blocks per sequence.
Qwen3-30B-A3B KV shape (4 KV heads, 8 query heads each, head_dim 128) or MLA (1 x 16, 576/512), bf16.

Run: PYTHONPATH=. python3 benchmarks/cpu_kernel_vs_flash.py [--shape mla] [--threads 15]
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
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    Hkv, G, dk, dv = (4, 8, 128, 128) if a.shape == "gqa" else (1, 16, 576, 512)
    assert cpu_kernel.kernel_available(), "the kernel did not build"
    print(f"{a.shape}: batch {a.batch}, {a.threads} threads, bf16; ms (GB/s of K+V read)")
    for nb in map(int, a.blocks.split(",")):
        n = nb * 256
        regs = [torch.randn(2 if a.shape == "gqa" else 1, Hkv, n + 256, dk, dtype=torch.bfloat16) for _ in range(a.batch)]
        kv = [(r[0, :, :n], r[1, :, :n]) if a.shape == "gqa" else (r[0, :, :n], r[0, :, :n, :dv]) for r in regs]
        q = torch.randn(a.batch, Hkv, G, dk, dtype=torch.bfloat16)
        nbytes = a.batch * Hkv * n * (dk + (dv if a.shape == "gqa" else 0)) * 2
        res = []
        for backend in ("flash", "kernel"):
            os.environ["WRITESCOPE_CPU_ATTENTION"] = backend
            ts = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                cpu_attend(q, kv, dk**-0.5, dv)
                ts.append(time.perf_counter() - t0)
            med = statistics.median(ts[2:])
            res.append(f"{backend} {med * 1e3:7.2f} ({nbytes / med / 1e9:5.1f})")
        print(f"  {nb:4d} blocks: " + "   ".join(res), flush=True)


if __name__ == "__main__":
    main()
