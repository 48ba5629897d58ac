"""Accuracy of the CPU attention kernel's bf16 paths against float64, next to torch's own bf16 CPU
flash op on the same kind of inputs: the figures behind tests/test_cpu_kernel.py's tolerance.

Prints torch's flash-op error, then the worst relative-norm error per sequence of the kernel over
the test file's cases (its shapes and lengths; every tuning and chunk of its split tests; 1 and 3
threads), for each bf16 path this CPU offers (``amx-emulated`` stands in for ``amx`` without AMX).

Run: PYTHONPATH=. python3 benchmarks/cpu_attention_error.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import test_cpu_kernel as T  # noqa: E402 - the test file's shapes, inputs and reference

from writescope.attention import cpu_kernel as K  # noqa: E402


def flash_error() -> float:
    f, g, worst = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, torch.Generator().manual_seed(0), 0.0
    for H, G, dk, n in [(1, 16, 576, 4097), (4, 8, 128, 4097), (2, 4, 64, 300)]:
        q, k, v = (torch.randn(1, H, m, dk, generator=g).bfloat16() for m in (G, n, n))
        o = f(q, k, v, scale=dk**-0.5)[0]
        s = torch.einsum("bhgd,bhnd->bhgn", q.double(), k.double()) * dk**-0.5
        ro = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(s, -1), v.double())
        worst = max(worst, ((o.double() - ro).norm() / ro.norm()).item())
    return worst


def main() -> None:
    print(f"torch's bf16 CPU flash op: relative error up to {flash_error():.2e}")
    ext = K._extension()
    paths = ["avx512bf16", "amx" if K.best_path() == "amx" else "amx-emulated"] if K.best_path() != "portable" else []
    for path in paths:
        os.environ["WRITESCOPE_CPU_ISA"] = path
        worst = (0.0, "")
        for tuning in (2, 1, 3, 4, 6):
            old = ext.set_tuning(tuning)
            for chunk in (1, 16, 33, 256, 4096):
                K.CHUNK = chunk
                for shape, (H, G, dk, dv, mla) in T.SHAPES.items():
                    if chunk != 256 and shape not in ("mla", "qwen3"):
                        continue
                    gen = torch.Generator().manual_seed(sum(map(ord, shape)) + chunk)
                    q, kv = T.make(T.LENGTHS if chunk == 256 else [0, 70, 1, 129, 0], H, G, dk, dv, mla, torch.bfloat16, gen)
                    for threads in (1, 3):
                        o, _ = K.attend(q, kv, dk**-0.5, threads=threads)
                        ro, _ = T.reference(q, kv, dk**-0.5, dv)
                        for i, x in enumerate(kv):
                            if x is not None:
                                e = ((o[i].double() - ro[i]).norm() / ro[i].norm()).item()
                                worst = max(worst, (e, f"{shape}, {x[0].shape[1]} keys, tuning {tuning}, chunk {chunk}"))
            ext.set_tuning(old)
        print(f"kernel, {path}: relative error up to {worst[0]:.2e} ({worst[1]})")


if __name__ == "__main__":
    main()
