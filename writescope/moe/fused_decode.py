"""The device experts of a decode step in two Triton launches (``WRITESCOPE_MOE_KERNEL=fused``, the
default; ``grouped`` takes torch's grouped GEMM instead).

Why: a decode step routes few (token, expert) assignments per block (DeepSeek-V2-Lite, 16 tokens
x top-6 = 96 over 64 experts), and torch's grouped GEMM read the activated experts' weights at
556-867 GB/s on the H200, 13-21% of its HBM bound (benchmarks/results/experts_h200.md). Between
two layers' attentions of a split step that expert phase is most of the hand-over the CPU waits
through. Here every hit expert's weights are read once, by many small programs (measured on the
H200, run 17 of benchmarks/results/gpu_decode_h200.md: DeepSeek-V2-Lite's 16-token expert phase
0.87 ms against 1.11 ms grouped; whole 16 x 32K steps 281 ms against 317 for ``writescope``, 323
against 413 for ``gpu``; run 18: Qwen3-30B-A3B 4 x 32K with its host experts read in place 304 ms
against 343 ms streamed for ``static:0.5``):

- ``_gate_up``: one program per (expert slot g, tile of BLOCK_N intermediate columns) runs over
  its group's assignment rows (sorted by slot) in blocks of BLOCK_M, gathers their tokens' x
  rows by index, and forms ``a = silu(x W_gate^T) * (x W_up^T)`` (fp32 accumulation) into
  ``act [rows, I]`` in x's dtype;
- ``_down``: one program per (slot g, tile of BLOCK_N output columns) forms ``act W_down^T``,
  scales each row by its routing weight (fp32) and adds it atomically into ``out [T, D]`` fp32 at
  the token's row (the sum over a token's experts then differs from run to run by fp32 rounding).

Groups with no rows cost one program that loads two integers; a group's rows are tiled by
:func:`block_m` (one tile up to 64 tokens). Rows of host experts (slot G) are
sorted after every group and never touched, as in :mod:`writescope.moe.grouped`. The formula is
HF's (``Qwen3MoeSparseMoeBlock``: expert output x routing weight, summed); the rounding differs
(fp32 through SiLU x up, one bf16 rounding of ``a``, the weighted products and their sum in
fp32), within bf16 of the grouped path.

Shape legend: T tokens, K top-k, D hidden, I intermediate, G device expert slots.
"""

from __future__ import annotations

import os

import torch

from writescope.env import env_choice

try:  # Triton comes with torch's CUDA builds; CI's CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - where Triton is absent
    triton = None

MAX_ROWS = 1024  # (token, expert) assignments per call up to which the fused path is taken (decode)
BLOCK_N, BLOCK_K = 64, 128  # BLOCK_M (rows per tile) follows the token count: see block_m


def env_fused() -> bool:
    """``WRITESCOPE_MOE_KERNEL``: ``fused`` (the default: these kernels for decode-sized calls; host
    experts that would be streamed are then read in place) or ``grouped`` (torch's grouped GEMM, and
    host experts streamed by copies).

    Raises:
        ValueError: another value (names it and the choices).
    """
    return env_choice("WRITESCOPE_MOE_KERNEL", ("fused", "grouped")) == "fused"


def wanted(x: torch.Tensor, rows: int) -> bool:
    """Whether a block's device experts take this path for tokens ``x``: :func:`wanted_for`."""
    return wanted_for(x.dtype, x.device, rows)


def wanted_for(dtype: torch.dtype, device: torch.device, rows: int | None) -> bool:
    """``WRITESCOPE_MOE_KERNEL=fused`` (the default), Triton importable, bf16 or fp16 on
    CUDA (or CPU under ``TRITON_INTERPRET=1`` with the switch set to ``fused`` by name, tests
    only), and at most ``MAX_ROWS`` assignments
    (``rows`` None: not checked).

    Raises:
        ValueError: ``WRITESCOPE_MOE_KERNEL`` other than ``grouped`` or ``fused``.
    """
    if not env_fused():
        return False
    if triton is None or dtype not in (torch.bfloat16, torch.float16) or (rows is not None and rows > MAX_ROWS):
        return False
    if device.type == "cuda":
        return True
    # CPU tensors only under Triton's interpreter (tests), and only when asked for by name: the
    # interpreter is far too slow to be a default
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("WRITESCOPE_MOE_KERNEL", "").strip().lower() == "fused"


if triton is not None:

    @triton.jit
    def _gate_up(X, TOK, W13, ENDS, ACT, D, I, stride_xt, stride_wg, stride_wn, stride_at,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        g = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        end = tl.load(ENDS + g)
        start = tl.load(ENDS + g - 1, mask=g > 0, other=0)
        w = W13 + g.to(tl.int64) * stride_wg
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            r_mask = rows < end
            tok = tl.load(TOK + rows, mask=r_mask, other=0).to(tl.int64)
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < D
                x = tl.load(X + tok[:, None] * stride_xt + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                wk = k_mask[:, None] & n_mask[None, :]
                wg = tl.load(w + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wk, other=0.0)  # [BLOCK_K, BLOCK_N]
                wu = tl.load(w + (I + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=wk, other=0.0)
                acc_g = tl.dot(x, wg, acc_g)
                acc_u = tl.dot(x, wu, acc_u)
            a = acc_g * tl.sigmoid(acc_g) * acc_u
            tl.store(ACT + rows[:, None].to(tl.int64) * stride_at + offs_n[None, :], a.to(ACT.dtype.element_ty),
                     mask=r_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _down(ACT, TOK, RW, W2, ENDS, OUT, D, I, stride_at, stride_wg, stride_wd, stride_ot,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        g = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        end = tl.load(ENDS + g)
        start = tl.load(ENDS + g - 1, mask=g > 0, other=0)
        w = W2 + g.to(tl.int64) * stride_wg
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            r_mask = rows < end
            tok = tl.load(TOK + rows, mask=r_mask, other=0).to(tl.int64)
            rw = tl.load(RW + rows, mask=r_mask, other=0.0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < I
                a = tl.load(ACT + rows[:, None].to(tl.int64) * stride_at + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                wd = tl.load(w + offs_n[None, :] * stride_wd + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc = tl.dot(a, wd, acc)
            acc = acc * rw[:, None]
            tl.atomic_add(OUT + tok[:, None] * stride_ot + offs_n[None, :], acc, mask=r_mask[:, None] & n_mask[None, :])


def block_m(tokens: int) -> int:
    """Rows per tile for ``tokens`` tokens: 16, 32 or 64. A group holds at most one row per token
    (a token's top-k experts are distinct), so up to 64 tokens every expert's weights are read
    once; beyond, an expert with more than 64 rows reads them again per 64 (from L2 for device
    experts, over PCIe for host experts read in place)."""
    return 16 if tokens <= 16 else 32 if tokens <= 32 else 64


def fused_experts_into(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, slot_of: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, inter: int, out: torch.Tensor) -> None:
    """Add the device experts' weighted outputs into ``out`` (two launches, no host wait).

    Args:
        x: ``[T, D]`` tokens, bf16 or fp16, contiguous rows.
        weights: ``[T, K]`` float32 routing weights; ids: ``[T, K]`` int64 expert ids.
        slot_of: ``[E]`` int64, each expert's packed slot (G for host experts, skipped).
        w13: ``[G, 2I, D]`` gate rows then up rows; w2: ``[G, D, I]``; x's dtype, unit last stride.
        inter: I.
        out: ``[T, D]`` float32, accumulated into in place (atomic adds).

    Raises:
        RuntimeError: Triton is not importable.
    """
    if triton is None:
        raise RuntimeError("the fused expert kernels need Triton")
    T, K = ids.shape
    G, D = w13.shape[0], x.shape[1]
    if T == 0 or G == 0:
        return
    slot = slot_of[ids.flatten()]  # [T*K]
    order = torch.argsort(slot, stable=True)
    counts = torch.zeros(G + 1, dtype=torch.int32, device=x.device).scatter_add_(0, slot, torch.ones_like(slot, dtype=torch.int32))
    ends = counts[:G].cumsum(0, dtype=torch.int32)  # [G] group ends over the sorted rows
    tok = (order // K).to(torch.int32)
    rw = weights.flatten()[order].float().contiguous()
    x = x.contiguous()
    bm = block_m(T)
    act = torch.empty(T * K, inter, dtype=x.dtype, device=x.device)
    _gate_up[(G, triton.cdiv(inter, BLOCK_N))](x, tok, w13, ends, act, D, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
                                               BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    _down[(G, triton.cdiv(D, BLOCK_N))](act, tok, rw, w2, ends, out, D, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
                                        BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
