"""A CPU decode-attention kernel over the compute region (C++ in cpu_kernel.cpp, OpenMP; built on first use).

Why: torch's CPU flash-attention op is called once per sequence (the compute regions are separate
allocations), each call a parallel region, and it reached 27-35 GB/s under DMA contention on the
H200 host against 86 GB/s of read bandwidth (benchmarks/results/scheduler.md). This kernel attends
a whole batch in one parallel region: tasks are (sequence, KV head, chunk of ``CHUNK`` keys), each
reading its K rows once (scores of the G query heads sharing the KV head), then its V rows once,
in float32; it writes one partial (o, lse) per task, merged by lse afterwards (exact, as the
other partials; docs/DESIGN.md section 4).

Inputs are the compute region's per-head rows in place: K ``[Hkv, n, dk]`` and V ``[Hkv, n, dv]``
with unit stride along the last dim (any row and head strides: MLA's V is a view of the first 512
of the latent's 576 columns); bf16 or fp32. The
reference is :func:`writescope.attention.partial.attend_blocks` (plain torch), tested against it.

Two implementations of the per-task work, both exact (float32 accumulation), tested against the
reference on every build:
- AVX-512 (built where the compiler targets AVX-512 F/BW/VL, ``-march=native``; the H200 host
  has it): the scores of 8 query heads x 3 keys at a time (fewer heads: 4 x 6, 2 x 8, 1 x 8), and
  the values of 8 heads x 48 columns (4 x 96, 2 x 128, 1 x 128), each block a set of 8-24 register
  accumulators of fused multiply-adds, bf16 widened in registers; the softmax's exp is a vector
  polynomial (Cody-Waite range reduction, degree-7 Taylor, < 6e-9 relative truncation; exponents
  below -87 count as -87, NaN stays NaN) and the 1 / sum is applied once to the output.
- plain C++ loops left to the compiler's vectoriser (``PORTABLE``, or a build without AVX-512).

``kernel_available()`` is False where the extension cannot be built (no C++ compiler); callers
then use the flash op. Selected with ``WRITESCOPE_CPU_ATTENTION=kernel`` (default: ``flash``).
Measured only on the 2-core development machine (benchmarks/results/cpu_kernel.md): the AVX-512
path is 3.0-4.5x the plain loops from 4,352 keys, about 1.5x the flash op for MLA (1.2-1.8x over repeated runs) and 0.76-1.50x for GQA. It has
not run on the H200 host, where the flash op read MLA's latent at 14.3 GB/s (e2e.md); whether it
beats the flash op there, and so whether the roofline gives the CPU a share, is open. AVX512-BF16
products (two per lane) or AMX tiles, which that host has, are not used.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import torch

CHUNK = 512  # keys per task
PORTABLE = False  # True: the plain C++ loops even where the AVX-512 path was built (tests compare the two)

_SOURCE = Path(__file__).with_name("cpu_kernel.cpp")  # built by torch.utils.cpp_extension.load_inline

_EXT = None
_FAILED = False


def _extension():
    global _EXT, _FAILED
    if _EXT is None and not _FAILED:
        try:
            from torch.utils.cpp_extension import load_inline

            _EXT = load_inline("writescope_cpu_attention", cpp_sources=[_SOURCE.read_text()], extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing"],
                               extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # noqa: BLE001 - no compiler, or the build failed: the flash op is used
            _FAILED = True
            warnings.warn(f"the CPU attention kernel could not be built ({str(e)[:200]}); using torch's flash op", stacklevel=2)
    return _EXT


def kernel_available() -> bool:
    return _extension() is not None


def avx512_built() -> bool:
    """The kernel was built with its AVX-512 path (the compiler targets a CPU with AVX-512 F, BW
    and VL; ``-march=native``). False where the kernel is not available."""
    ext = _extension()
    return ext is not None and bool(ext.avx512)


def kernel_selected() -> bool:
    """``WRITESCOPE_CPU_ATTENTION=kernel`` and the kernel builds."""
    return os.environ.get("WRITESCOPE_CPU_ATTENTION", "flash").lower() == "kernel" and kernel_available()


def prepare(progress: bool = True) -> str:
    """Check ``WRITESCOPE_CPU_ATTENTION`` and build the kernel now if it is selected (about 45 s
    the first time on a machine, then cached by torch), so the build is not timed as part of a
    decode step. Returns the CPU attention in use, in words.

    Raises:
        ValueError: ``WRITESCOPE_CPU_ATTENTION`` is neither ``flash`` nor ``kernel`` (names it).
    """
    value = os.environ.get("WRITESCOPE_CPU_ATTENTION", "flash")
    if value.lower() not in ("flash", "kernel"):
        raise ValueError(f"WRITESCOPE_CPU_ATTENTION={value!r}: use 'flash' (torch's op, the default) or 'kernel' (the C++ kernel)")
    if value.lower() == "flash":
        return "torch's flash op"
    if progress and _EXT is None and not _FAILED:
        print("CPU attention: building the C++ kernel (once per machine, about a minute) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if not kernel_available():
        return "torch's flash op (the C++ kernel could not be built; see the warning)"
    if progress and time.perf_counter() - t0 > 1.0:
        print(f"CPU attention: C++ kernel ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return f"C++ kernel ({'AVX-512' if avx512_built() else 'plain loops, no AVX-512 here'})"


def usable(q: torch.Tensor, kv: list) -> bool:
    """The kernel handles these inputs: one dtype (bf16 or fp32) for the batch's keys and values,
    K as wide as q, rows with unit last stride, at least one sequence with keys."""
    if q.dtype not in (torch.float32, torch.bfloat16):
        return False
    dtypes = {t.dtype for x in kv if x is not None for t in x}
    if len(dtypes) != 1 or dtypes.pop() not in (torch.float32, torch.bfloat16):
        return False  # (no keys at all: nothing for the kernel to do either)
    for x in kv:
        if x is None:
            continue
        k, v = x
        if k.shape[-1] != q.shape[-1] or k.stride(-1) != 1 or v.stride(-1) != 1:
            return False
    return True


def kernel_partials(q: torch.Tensor, kv: list, scale: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Partials per non-empty sequence i: ``{i: (o [c_i, Hkv, G, dv], lse [c_i, Hkv, G])}``
    float32, one row per chunk of ``CHUNK`` keys (c_i = ceil(n_i / CHUNK)). All sequences in one
    call and one parallel region.

    Args:
        q: ``[B, Hkv, G, dk]``; kv: per sequence ``(k [Hkv, n, dk], v [Hkv, n, dv])`` or None.
    """
    rows = [i for i, x in enumerate(kv) if x is not None]
    if not rows:
        return {}
    qs = q[rows]
    o, lse = _extension().attend(qs, [kv[i][0] for i in rows], [kv[i][1] for i in rows], CHUNK, float(scale), PORTABLE)
    # tasks are ordered (sequence, head, chunk): each sequence's block viewed as [chunk, head, ...]
    H, out, t = q.shape[1], {}, 0
    for i in rows:
        c = -(-kv[i][0].shape[1] // CHUNK)
        out[i] = (o[t : t + H * c].view(H, c, *o.shape[1:]).transpose(0, 1), lse[t : t + H * c].view(H, c, lse.shape[1]).transpose(0, 1))
        t += H * c
    return out
