"""Routed experts in host memory computed by a C++ kernel (cpu_experts.cpp and its headers;
OpenMP; built on first use and cached by torch): every host expert of one MoE layer's step in one
call, each hit expert's weights read once whatever its number of tokens (docs/DESIGN.md section 6).

The weights are read in place from the block's host pack (``PackedExperts``: ``w13 [E_host, 2I,
D]``, gate rows then up rows, and ``w2 [E_host, D, I]``): no re-layout and no second copy. For
expert e with tokens x ``[m, D]``: g = x W_gate^T, u = x W_up^T, h = silu(g) u (fp32, then rounded
to bf16 as torch's bf16 expert rounds it), y = h W_down^T, returned times the routing weight.
Accumulation is fp32 on every path; y is rounded once to x's dtype.

Work plan: phase 1 cuts the gate/up rows of all the call's experts into units of 16 features (16
gate + 16 up rows), one equal range of units per thread; after a barrier phase 2 cuts the down
rows into units of 32 output features the same way. So each weight byte is read by one thread,
once; an expert's tokens are all handled while its rows are in cache.

The same computation runs on a persistent native thread, fed through flags in pinned memory, in
:class:`writescope.moe.expert_worker.ExpertWorker` (expert_worker.h; one C++ function, ``compute``,
serves both).

Three paths, chosen at run time from the CPU's flags (``WRITESCOPE_EXPERT_ISA`` forces one):
- ``amx``: AMX-BF16 tiles, Y^T = W X^T with the weight rows as the A tile read in place (16 rows x
  32 inputs at the matrix's row stride) and the tokens packed per call into the B tile's bf16
  pairs. Needs bf16, D % 32 == 0 and I % 32 == 0 (else ``avx512bf16``). The tile permission is
  asked once per process (arch_prctl ARCH_REQ_XCOMP_PERM); if refused, the path is not offered.
- ``avx512bf16``: ``vdpbf16ps`` dot products along the input dimension, 16 accumulators (rows x
  tokens) reduced at the end (AMD Zen 4, the CI machines; Intel from Cooper Lake). Needs bf16.
- ``portable``: plain C++ loops in fp32 (any x86-64 CPU; bf16 or fp32).
``amx-emulated`` (tests only) runs the AMX path's code with the tiles emulated in C++.
"""

from __future__ import annotations

from pathlib import Path

import torch

from writescope.native import build

PATHS = build.PATHS  # index = the extension's path number; the last (amx-emulated) is for tests
ENV = "WRITESCOPE_EXPERT_ISA"

_DIR = Path(__file__).parent
_SOURCES = ("cpu_experts.cpp", "cpu_experts_avx512.h", "cpu_experts_amx.h", "cpu_experts_amx_tiles.h", "expert_worker.h")

_EXTENSION = build.Extension("writescope_cpu_experts", _DIR, _SOURCES, "host experts use torch's GEMMs")


def _extension():
    return _EXTENSION.get()


def kernel_available() -> bool:
    """Whether the kernel builds here (built on the first call)."""
    return _extension() is not None


def _ext():
    ext = _extension()
    if ext is None:
        raise RuntimeError("the host-expert kernel could not be built (see the warning)")
    return ext


def best_path() -> str:
    """The fastest path this CPU and OS offer (``amx``, ``avx512bf16`` or ``portable``).

    Raises:
        RuntimeError: the kernel could not be built.
    """
    return PATHS[_ext().best()]


def requested_path() -> int:
    """``WRITESCOPE_EXPERT_ISA`` as the extension's path number (-1: auto, the best offered).

    Raises:
        ValueError: an unknown value (names it and the choices).
    """
    return build.requested_path(ENV)


def path_for(dtype: torch.dtype, hidden: int, inter: int) -> str:
    """The path :func:`host_experts_forward` takes for experts of this dtype and shape (D = hidden,
    I = inter), given ``WRITESCOPE_EXPERT_ISA``: a requested path is lowered where the shape or
    dtype needs it (amx: bf16 and D, I multiples of 32; avx512bf16: bf16).

    Raises:
        ValueError: ``WRITESCOPE_EXPERT_ISA`` unknown; RuntimeError: it names a path this CPU lacks,
            or the kernel could not be built.
    """
    return PATHS[_ext().path_for(requested_path(), dtype == torch.bfloat16, int(hidden), int(inter))]


def prepare(progress: bool = True) -> str:
    """Check ``WRITESCOPE_EXPERT_ISA`` and build the kernel now (the first time on a machine:
    32-33 s measured on the dev box and the H200 host; then cached by torch), so the build is not
    timed inside the first step. Returns the path ``auto`` picks (or the forced one), in words.

    Raises:
        ValueError: an unknown ``WRITESCOPE_EXPERT_ISA``, or a path this CPU lacks.
    """
    req = requested_path()
    if not _EXTENSION.build(progress, "host experts", "about half a minute"):
        return "torch's GEMMs (the C++ kernel could not be built; see the warning)"
    best = best_path()
    need = PATHS.index("avx512bf16") if req == PATHS.index("amx-emulated") else req  # the emulated tiles run on AVX-512
    if req >= 0 and need > PATHS.index(best):
        raise ValueError(f"{ENV}={PATHS[req]}: this CPU offers at most {best}; unset it or choose a lower path")
    return f"C++ kernel ({PATHS[req] if req >= 0 else best})"


def check_weights(x, w13, w2) -> int:
    """The host pack's errors for tokens ``x`` ``[n, D]``, as ValueError naming the bad value:
    ``w13 [E, 2I, D]`` and ``w2 [E, D, I]`` of x's dtype with unit last stride. Returns E."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, D] and w2 [E, D, I], got {list(w13.shape)} and {list(w2.shape)}")
    E, two_i, D = w13.shape
    I = two_i // 2
    if two_i % 2 or D != x.shape[1] or tuple(w2.shape) != (E, D, I):
        raise ValueError(f"shapes do not match: x {list(x.shape)}, w13 {list(w13.shape)} (want [E, 2I, {x.shape[1]}]), "
                         f"w2 {list(w2.shape)} (want [{E}, {x.shape[1]}, {I}])")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13 and w2 must have one dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError(f"weight rows must have unit stride (read in place), got strides {w13.stride()} and {w2.stride()}")
    return E


def _check(x, counts, w13, w2, slots, weights) -> None:
    """The argument errors, as ValueError naming the bad value (see host_experts_forward)."""
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("weights", weights)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be [n, D] bf16 or fp32, got {list(x.shape)} {x.dtype}")
    E = check_weights(x, w13, w2)
    if len(counts) != len(slots):
        raise ValueError(f"{len(counts)} counts for {len(slots)} slots: one token count per expert")
    bad = [s for s in slots if not 0 <= int(s) < E]
    if bad:
        raise ValueError(f"slots {bad[:5]} outside [0, {E}) (w13 holds {E} experts)")
    neg = [c for c in counts if int(c) < 0]
    if neg or sum(int(c) for c in counts) != x.shape[0]:
        raise ValueError(f"counts {list(counts)[:8]} must be >= 0 and sum to x's {x.shape[0]} rows")
    if weights.shape != (x.shape[0],) or not weights.dtype.is_floating_point:
        raise ValueError(f"weights must be a float [{x.shape[0]}] tensor (one routing weight per row of x), got {list(weights.shape)} {weights.dtype}")


def host_experts_forward(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor, slots: list[int],
                         weights: torch.Tensor, threads: int | None = None, return_path: bool = False):
    """All host experts of one MoE step in one call.

    Args:
        x: ``[n, D]`` bf16 or fp32 CPU tokens, grouped by expert: the first ``counts[0]`` rows go
            to the expert in slot ``slots[0]``, the next ``counts[1]`` to ``slots[1]``, and so on.
        counts: tokens per group (0 allowed), summing to n.
        w13: ``[E_host, 2I, D]`` gate rows then up rows; w2: ``[E_host, D, I]``; x's dtype, unit
            last stride (read in place, whatever their row and expert strides).
        slots: the packed slot (first index of w13 and w2) of each group.
        weights: ``[n]`` routing weights (any float dtype; used in fp32).
        threads: OpenMP threads of the call (default: torch's intra-op count on this thread).
        return_path: also return the path that ran (``amx``, ``avx512bf16``, ``portable``, ...).

    Returns:
        ``y [n, D]`` in x's dtype: row i = weights[i] * expert(x[i]); with ``return_path``,
        ``(y, path)``.

    Raises:
        ValueError: bad arguments (names the value); RuntimeError: the kernel could not be built,
            or ``WRITESCOPE_EXPERT_ISA`` forces a path this CPU lacks.
    """
    _check(x, counts, w13, w2, slots, weights)
    threads = torch.get_num_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    rw = weights.to(torch.float32).contiguous()
    y, isa = _ext().forward(x.contiguous(), w13, w2, [int(s) for s in slots], [int(c) for c in counts], rw, requested_path(), threads)
    return (y, PATHS[isa]) if return_path else y


def read_bytes(t: torch.Tensor, threads: int) -> int:
    """A plain read of a contiguous CPU tensor's bytes by ``threads`` threads (the reference
    rate for the kernel's weight reads; benchmarks/cpu_experts.py). Returns an xor fold."""
    return _ext().read_bytes(t, int(threads))
