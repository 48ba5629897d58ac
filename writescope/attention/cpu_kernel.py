"""The CPU decode-attention kernel over the compute region (C++: cpu_kernel.cpp and its two
headers; OpenMP; built on first use and cached by torch).

One call attends a whole decode batch where its keys lie (no copy, no re-layout) and returns the
merged partial of every sequence: ``(o [B, kv_heads, G, dv], lse [B, kv_heads, G])`` in float32,
natural-log lse, empty sequences (0, -inf), NaN kept (docs/DESIGN.md section 4's conventions).

Work plan (split-K, even over threads whatever the lengths): every (sequence, KV head, group of
<= 16 query heads) is a segment of n keys; the segments' keys, end to end, are cut into one equal
range per thread; a thread attends its part of each segment in chunks of ``CHUNK`` keys with an
online softmax, and the parts of a segment are merged by log-sum-exp at the end of the call. MLA
(DeepSeek-V2): V is a view of the first 512 of the latent's 576 columns, so a chunk's latent is read
from memory once, as keys, and again from the cache as values. GQA: one pass over a KV head's keys
and values serves all of its query heads.

Three paths, chosen at run time from the CPU's flags (``WRITESCOPE_CPU_ISA`` forces one):
- ``amx``: AMX-BF16 tiles (Intel Sapphire Rapids and later; the H200 host). Scores as K Q^T with
  the keys as the A tile read in place (16 keys x 32 columns), values as P V on V's rows where
  they lie (two products per tile, even and odd columns; dv % 32 == 0, else V is re-packed per
  chunk into bf16 key pairs), with software prefetch paced over the whole chunk, one chunk ahead
  (prefetch_pacer.h; ``WRITESCOPE_CPU_TUNING`` picks other orders, for benchmarks). Needs bf16 KV, dk % 32 == 0, dv % 16 == 0 (else
  ``avx512bf16``). The tile permission is asked once per process (arch_prctl ARCH_REQ_XCOMP_PERM);
  if refused, the path is not offered.
- ``avx512bf16``: AVX512-BF16 dot products (``vdpbf16ps``) for both products (AMD Zen 4, the CI
  machines; Intel from Cooper Lake). Needs bf16 KV (else ``portable``).
- ``portable``: plain C++ loops in float32 (any x86-64 CPU, fp32 KV).
The bf16 paths round the queries and the softmax weights p to bf16 (as GPU flash attention
rounds p) and accumulate in float32; the softmax runs in float32 with the lse in float32.

``WRITESCOPE_CPU_ATTENTION``: ``kernel`` (the default where it builds) or ``flash`` (torch's
``_scaled_dot_product_flash_attention_for_cpu``, one call per sequence; see partial.py).
Measured rates: benchmarks/results/cpu_attention.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from writescope.env import env_choice
from writescope.native import build

CHUNK = 128  # keys per chunk of a portion (its scores, p and values stay in L2; 128 measured faster than 256 on the H200 host)
PATHS = build.PATHS  # index = the extension's path number; the last (amx-emulated) is for tests

_DIR = Path(__file__).parent
_SOURCES = ("cpu_kernel.cpp", "cpu_kernel_avx512.h", "cpu_kernel_amx.h", "cpu_kernel_amx_tiles.h", "prefetch_pacer.h", "cpu_worker.h")

_EXTENSION = build.Extension("writescope_cpu_attention_v2", _DIR, _SOURCES, "using torch's flash op")


TUNING_ENV = "WRITESCOPE_CPU_TUNING"
DYNAMIC_SPLIT = 1024  # cpu_kernel.cpp's Tuning bit: the keys cut into several ranges per thread, taken as threads finish
_tuning_applied: str | None = None  # the variable's text last applied (None: not yet looked at)
_default_tuning: int | None = None  # the extension's own default, restored when the variable goes


def tuning_from_env() -> int | None:
    """``WRITESCOPE_CPU_TUNING``: the kernel's tuning flags (cpu_kernel.cpp, ``Tuning``: 1
    linear first, 2 scores prefetch, 4 values on V in place, 8 paced prefetch, 16 paced into L1,
    32 paced two chunks ahead: the bf16 paths' order of work; 1024 the dynamic split of the keys
    over the threads, every path), an integer of those bits; None where unset (the kernel's default).

    Raises:
        ValueError: not an integer made of those bits (the timing-only flags 64 to 512 are refused).
    """
    raw = os.environ.get(TUNING_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw, 0)
    except ValueError:
        value = -1
    if value < 0 or value & ~(63 | DYNAMIC_SPLIT):
        raise ValueError(f"{TUNING_ENV}={raw!r}: use an integer 0 to 63, plus {DYNAMIC_SPLIT} for the dynamic split "
                         "(cpu_kernel.cpp, Tuning), or leave it unset for the default")
    return value


def _extension():
    """The built extension (None where it does not build), with ``WRITESCOPE_CPU_TUNING`` applied
    whenever its text differs from what was last applied (unset: the kernel's own default)."""
    global _tuning_applied, _default_tuning
    ext = _EXTENSION.get()
    if ext is not None:
        raw = os.environ.get(TUNING_ENV, "").strip()
        if raw != _tuning_applied:
            value = tuning_from_env()  # raises on a bad value (prepare() checks it before any work)
            if _default_tuning is None:
                _default_tuning = ext.tuning()
            ext.set_tuning(_default_tuning if value is None else value)
            _tuning_applied = raw
    return ext


def kernel_available() -> bool:
    return _extension() is not None


def best_path() -> str:
    """The fastest path this CPU and OS offer (``amx``, ``avx512bf16`` or ``portable``).

    Raises:
        RuntimeError: the kernel could not be built.
    """
    ext = _extension()
    if ext is None:
        raise RuntimeError("the CPU attention kernel could not be built (see the warning)")
    return PATHS[ext.best()]


def requested_path() -> int:
    """``WRITESCOPE_CPU_ISA`` as the extension's path number (-1: auto, the best offered).

    Raises:
        ValueError: an unknown value (names it and the choices).
    """
    return build.requested_path("WRITESCOPE_CPU_ISA")


def path_for(dtype: torch.dtype, dk: int, dv: int) -> str:
    """The path :func:`attend` takes for keys of this dtype and widths, given ``WRITESCOPE_CPU_ISA``.

    Raises:
        ValueError: ``WRITESCOPE_CPU_ISA`` unknown; RuntimeError: it names a path this CPU lacks.
    """
    return PATHS[_extension().path_for(requested_path(), dtype == torch.bfloat16, dk, dv)]


def attention_choice() -> str:
    """``WRITESCOPE_CPU_ATTENTION``: ``"kernel"`` (the C++ kernel, the default) or ``"flash"``
    (torch's op), read without building anything.

    Raises:
        ValueError: another value (names it and the choices).
    """
    return env_choice("WRITESCOPE_CPU_ATTENTION", ("kernel", "flash"))


def kernel_selected() -> bool:
    """``WRITESCOPE_CPU_ATTENTION`` is ``kernel`` (the default) and the kernel builds."""
    return attention_choice() == "kernel" and kernel_available()


def backend_key() -> str:
    """What the CPU side's calibration depends on: ``"flash"`` or ``"kernel <path>"`` (the path
    ``WRITESCOPE_CPU_ISA`` asks for, else the best this CPU offers)."""
    if not kernel_selected():
        return "flash"
    req = requested_path()
    tuning = tuning_from_env()
    return f"kernel {PATHS[req] if req >= 0 else best_path()}" + ("" if tuning is None else f" tuning {tuning}")


def prepare(progress: bool = True) -> str:
    """Check ``WRITESCOPE_CPU_ATTENTION``, ``WRITESCOPE_CPU_ISA`` and ``WRITESCOPE_CPU_TUNING`` and build the kernel now
    (about a minute the first time on a machine, then cached by torch), so the build is neither
    timed as part of a decode step nor met after the weights load. Returns the CPU attention in
    use, in words.

    Raises:
        ValueError: a variable has an unknown value, or ``WRITESCOPE_CPU_ISA`` names a path
            this CPU lacks (names it and what the CPU offers).
    """
    if attention_choice() == "flash":
        return "torch's flash op"
    req = requested_path()
    tuning = tuning_from_env()
    if req == PATHS.index("amx-emulated"):
        raise ValueError("WRITESCOPE_CPU_ISA=amx-emulated is a test path (AMX tiles emulated, slow): use auto, amx, avx512bf16 or portable")
    if not _EXTENSION.build(progress, "CPU attention", "about a minute"):
        return "torch's flash op (the C++ kernel could not be built; see the warning)"
    best = best_path()
    if req > PATHS.index(best):
        raise ValueError(f"WRITESCOPE_CPU_ISA={PATHS[req]}: this CPU offers at most {best}; unset it or choose a lower path")
    return f"C++ kernel ({PATHS[req] if req >= 0 else best}" + ("" if tuning is None else f", tuning {tuning}") + ")"


def usable(q: torch.Tensor, kv: list) -> bool:
    """The kernel handles these inputs: one dtype (bf16 or fp32) for the batch's keys and values,
    K as wide as q, rows with unit last stride, at least one sequence with keys."""
    if q.dtype not in (torch.float32, torch.bfloat16) or q.device.type != "cpu":
        return False
    dtypes = {t.dtype for x in kv if x is not None for t in x}
    if len(dtypes) != 1 or dtypes.pop() not in (torch.float32, torch.bfloat16):
        return False  # (no keys at all: nothing for the kernel to do either)
    widths = {x[1].shape[-1] for x in kv if x is not None}
    if len(widths) != 1:
        return False
    for x in kv:
        if x is None:
            continue
        k, v = x
        if k.device.type != "cpu" or v.device.type != "cpu":
            return False
        if k.shape[-1] != q.shape[-1] or k.stride(-1) != 1 or v.stride(-1) != 1 or k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[1]:
            return False
    return True


def attend(q: torch.Tensor, kv: list, scale: float, out: tuple[torch.Tensor, torch.Tensor] | None = None,
           threads: int | None = None, dv: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of the batch over keys that stay where they are in host memory.

    Args:
        q: ``[B, kv_heads, G, dk]`` bf16 or fp32, on the CPU.
        kv: per sequence ``(k [kv_heads, n, dk], v [kv_heads, n, dv])`` views with unit last
            stride (any head and row strides; MLA: ``v = k[..., :dv]``), or None (no keys).
        scale: softmax scale.
        out: optional ``(o [B, kv_heads, G, dv], lse [B, kv_heads, G])`` contiguous fp32 tensors
            (pinned ones, say) to write into.
        threads: threads of the call (default: torch's intra-op count on the calling thread).
        dv: the value width (default: the first given v's, else dk): it sets the output's width
            when no sequence has keys.

    Returns:
        ``(o, lse)`` float32; empty sequences (0, -inf).

    Raises:
        RuntimeError: inputs the kernel cannot take (check :func:`usable` first) or a forced path
            this CPU lacks.
    """
    rows = [i for i, x in enumerate(kv) if x is not None and x[0].shape[1] > 0]
    ks = [kv[i][0] for i in rows]
    vs = [kv[i][1] for i in rows]
    if dv is None:
        dv = next((x[1].shape[-1] for x in kv if x is not None), q.shape[-1])
    o, lse = out if out is not None else (None, None)
    return tuple(_extension().attend(q, ks, vs, rows, CHUNK, float(scale), requested_path(), threads or torch.get_num_threads(), o, lse, dv))
