"""Decode attention on the GPU side in Triton: one launch per set of blocks, one merge launch.

Replaces, on CUDA, the plain-torch partials of :mod:`writescope.attention.partial` (about ten
kernels and a float32 copy of every block per ping-pong fill, plus a stack of the D-windows and
a dozen merge kernels per layer) by:

- :func:`block_partials_into`: one program per (block, kv head) attends the block's ``n`` valid
  keys (``n <= D``) for the kv head's G query heads and writes the partial ``(o, lse)``; blocks
  come either from one buffer (a ping-pong fill: block j at ``j * stride``) or from anywhere in
  one allocation's address space through element offsets (the D-windows of all sequences, read
  in place, no stack);
- :func:`merge_into`: one program per (sequence, kv head) merges its window partial, its
  load-region partials (a CSR range) and optionally the CPU partial by log-sum-exp, and writes
  the output in the query's dtype.

Numerics: keys, values and q in bf16/fp16 as stored; scores, softmax statistics and the output
accumulate in float32; probabilities are rounded to the value dtype for the P·V product (as in
FlashAttention-2). The formula is the online softmax (Milakov & Gimelshein 2018) with the exact
lse merge of merge.py. An empty block (``n = 0``) gives (0, -inf); merging only empty partials
gives (0, -inf).

Head widths: the key width dk is split into a power-of-two main part and a masked tail (MLA's
576 = 512 + 64, GQA's 128 = 128 + 0), so no 1024-wide tile is padded; with ``v_in_k`` the values
are the key's first dv columns (MLA's latent) and reuse the loaded key tile.

Without Triton or CUDA nothing here runs: callers use the torch path (``available()``).
"""

from __future__ import annotations

import os

import torch

from writescope.env import env_choice

try:  # Triton comes with torch's CUDA builds; CI's CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton path runs for a cache of ``dtype`` on ``device``: CUDA (or
    ``TRITON_INTERPRET=1`` for CPU tensors, tests only), Triton importable, bf16 or fp16, and not
    switched off by ``WRITESCOPE_GPU_ATTENTION=torch``.

    Raises:
        ValueError: ``WRITESCOPE_GPU_ATTENTION`` other than ``triton`` (the default) or ``torch``.
    """
    mode = env_choice("WRITESCOPE_GPU_ATTENTION", ("triton", "torch"))
    if mode == "torch" or triton is None or dtype not in (torch.bfloat16, torch.float16):
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _pow2_split(width: int) -> tuple[int, int]:
    """``width`` as a power-of-two main part and a power-of-two (masked) tail: 576 -> (512, 64),
    128 -> (128, 0), 24 -> (16, 8), 1 -> (1, 0)... with tl.dot's minimum of 16 for the main part."""
    main = 1 << (width.bit_length() - 1)
    rest = width - main
    tail = 0 if rest == 0 else 1 << (rest - 1).bit_length()
    return max(main, 16), (max(tail, 16) if tail else 0)


if triton is not None:

    # out_base and layer_off change from launch to launch: not specialised (Triton would compile a
    # variant for 1, for multiples of 16 and for the rest, inside a decode step)
    @triton.jit(do_not_specialize=["layer_off", "out_base"])
    def _blocks_kernel(
        Q, KV, OFF, SEQ, LEN, O, LSE,
        layer_off, blk_stride, v_off, head_stride, tok_stride,
        stride_qb, stride_qh, stride_qg,
        stride_ob, stride_oh, stride_og, stride_lb, stride_lh,
        out_base, sm_scale, G, dk, dv, D,
        USE_OFF: tl.constexpr, OFF_ALIGN: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_LEN: tl.constexpr, V_IN_K: tl.constexpr,
        BLOCK_G: tl.constexpr, DK_A: tl.constexpr, DK_B: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        if USE_OFF:
            off = tl.load(OFF + pid) + layer_off
            if OFF_ALIGN:  # every offset a multiple of 8 elements (16 bytes): vector loads, as for consecutive blocks
                off = tl.multiple_of(off, 8)
            base = KV + off
        else:
            base = KV + pid.to(tl.int64) * blk_stride
        if HAS_SEQ:
            seq = tl.load(SEQ + out_base + pid)
        else:
            seq = pid
        if HAS_LEN:
            n = tl.load(LEN + pid)
        else:
            n = D
        base = base + h * head_stride
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        da = tl.arange(0, DK_A)
        dvr = tl.arange(0, BLOCK_DV)
        q_row = Q + seq.to(tl.int64) * stride_qb + h * stride_qh + g[:, None] * stride_qg
        q_a = tl.load(q_row + da[None, :], mask=gmask[:, None] & (da[None, :] < dk), other=0.0)
        if DK_B > 0:
            db = tl.arange(0, DK_B)
            q_b = tl.load(q_row + DK_A + db[None, :], mask=gmask[:, None] & (DK_A + db[None, :] < dk), other=0.0)
        qk_scale = sm_scale * 1.4426950408889634  # log2(e): the softmax in base 2
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        for t0 in range(0, D, BLOCK_N):  # to D, masked past n (n is at most D; windows are short anyway)
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < n
            k_row = base + t[:, None].to(tl.int64) * tok_stride
            k_a = tl.load(k_row + da[None, :], mask=tmask[:, None] & (da[None, :] < dk), other=0.0)
            s = tl.dot(q_a, tl.trans(k_a))
            if DK_B > 0:
                k_b = tl.load(k_row + DK_A + db[None, :], mask=tmask[:, None] & (DK_A + db[None, :] < dk), other=0.0)
                s += tl.dot(q_b, tl.trans(k_b))
            s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no valid key yet: weights 0, not NaN
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if V_IN_K:
                v = k_a
            else:
                v = tl.load(k_row + v_off + dvr[None, :], mask=tmask[:, None] & (dvr[None, :] < dv), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        row = (out_base + pid).to(tl.int64)
        tl.store(O + row * stride_ob + h * stride_oh + g[:, None] * stride_og + dvr[None, :], o, mask=gmask[:, None] & (dvr[None, :] < dv))
        tl.store(LSE + row * stride_lb + h * stride_lh + g, lse, mask=gmask)

    @triton.jit
    def _merge_in(acc, l, m, m_safe, op, lp):
        """One partial (op, lp) into the running (acc, l) relative to max m (m_safe: m, or 0 while
        every partial so far is empty): an empty partial weighs 0, NaN propagates through wp."""
        m_new = tl.maximum(m, lp)
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.where(m == float("-inf"), 0.0, tl.exp(m_safe - m_new_safe))
        wp = tl.exp(lp - m_new_safe)
        return acc * a[:, None] + op * wp[:, None], l * a + wp, m_new, m_new_safe

    @triton.jit
    def _merge_kernel(
        O_W, L_W, O_L, L_L, STARTS, O_C, L_C, OUT,
        s_wb, s_wh, s_wg, s_lwb, s_lwh,
        s_pb, s_ph, s_pg, s_lpb, s_lph,
        s_cb, s_ch, s_cg, s_lcb, s_lch,
        s_outb, s_outh,
        G, dv,
        HAS_LOAD: tl.constexpr, HAS_CPU: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_DV)
        gmask = g < G
        omask = gmask[:, None] & (d[None, :] < dv)
        # the window partial (always present: an empty window is (0, -inf))
        m = tl.load(L_W + b * s_lwb + h * s_lwh + g, mask=gmask, other=float("-inf"))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.where(m == float("-inf"), 0.0, 1.0)  # weights relative to m
        acc = tl.load(O_W + b * s_wb + h * s_wh + g[:, None] * s_wg + d[None, :], mask=omask, other=0.0) * w[:, None]
        l = w
        if HAS_LOAD:
            j0 = tl.load(STARTS + b)
            j1 = tl.load(STARTS + b + 1)
            for j in range(j0, j1):  # STARTS is int64: j and the row offsets below are 64-bit
                jj = j
                lp = tl.load(L_L + jj * s_lpb + h * s_lph + g, mask=gmask, other=float("-inf"))
                op = tl.load(O_L + jj * s_pb + h * s_ph + g[:, None] * s_pg + d[None, :], mask=omask, other=0.0)
                acc, l, m, m_safe = _merge_in(acc, l, m, m_safe, op, lp)
        if HAS_CPU:
            lp = tl.load(L_C + b * s_lcb + h * s_lch + g, mask=gmask, other=float("-inf"))
            op = tl.load(O_C + b * s_cb + h * s_ch + g[:, None] * s_cg + d[None, :], mask=omask, other=0.0)
            acc, l, m, m_safe = _merge_in(acc, l, m, m_safe, op, lp)
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(OUT + b * s_outb + (h * G + g[:, None]) * s_outh + d[None, :], o.to(OUT.dtype.element_ty), mask=omask)


# launch settings per head class ("wide": MLA's 576/512 latent; "narrow": GQA heads up to 256);
# WRITESCOPE_GPU_TILES overrides them for benchmarks/gpu_attention.py, e.g.
# "wide:BLOCK_N=32,num_warps=4,V_IN_K=0;narrow:BLOCK_N=64"
TILES = {"wide": dict(BLOCK_N=32, num_warps=4, num_stages=2, V_IN_K=0), "narrow": dict(BLOCK_N=64, num_warps=4, num_stages=2, V_IN_K=0)}


def tile_settings() -> dict[str, dict[str, int]]:
    """TILES with ``WRITESCOPE_GPU_TILES`` applied.

    Raises:
        ValueError: a malformed override (names it and the expected form).
    """
    out = {k: dict(v) for k, v in TILES.items()}
    spec = os.environ.get("WRITESCOPE_GPU_TILES", "").strip()
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        try:
            cls, items = part.split(":", 1)
            for item in items.split(","):
                key, val = item.split("=")
                if cls.strip() not in out or key.strip() not in out[cls.strip()]:
                    raise KeyError(key)
                out[cls.strip()][key.strip()] = int(val)
        except (ValueError, KeyError):
            raise ValueError(f"WRITESCOPE_GPU_TILES={spec!r}: use 'wide:BLOCK_N=32,num_warps=4,num_stages=2,V_IN_K=0;narrow:...'") from None
    return out


_TILES_MADE: dict[tuple, dict] = {}  # (dk, dv, parts, G, WRITESCOPE_GPU_TILES) -> _tiles' settings: a launch reads them, not the parse


def _tiles(dk: int, dv: int, parts: int, G: int) -> dict:
    """Launch settings for a head shape: BLOCK_N keys per step, and whether MLA's values reuse the
    loaded key tile (V_IN_K: only when the values are exactly the key's power-of-two main part).
    Kept per shape and ``WRITESCOPE_GPU_TILES`` text (every launch asks; parsing took tens of us)."""
    key = (dk, dv, parts, G, os.environ.get("WRITESCOPE_GPU_TILES", ""))
    hit = _TILES_MADE.get(key)
    if hit is None:
        hit = _TILES_MADE[key] = _make_tiles(dk, dv, parts, G)
    return hit


def _make_tiles(dk: int, dv: int, parts: int, G: int) -> dict:
    dk_a, dk_b = _pow2_split(dk)
    t = tile_settings()["wide" if dk_a + dk_b > 256 else "narrow"]
    v_in_k = bool(t["V_IN_K"]) and parts == 1 and dv == dk_a and dv <= dk
    return dict(DK_A=dk_a, DK_B=dk_b, BLOCK_DV=dk_a if v_in_k else max(16, triton.next_power_of_2(dv)),
                BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=t["BLOCK_N"], V_IN_K=v_in_k,
                num_warps=t["num_warps"], num_stages=t["num_stages"])


def block_partials_into(q: torch.Tensor, kv: torch.Tensor, parts: int, dv: int, scale: float, o: torch.Tensor, lse: torch.Tensor,
                        out_base: int = 0, count: int | None = None, offsets: torch.Tensor | None = None, layer_off: int = 0,
                        seq: torch.Tensor | None = None, lengths: torch.Tensor | None = None, window: int | None = None,
                        offsets_aligned: bool = False) -> None:
    """Partial attention of each block's sequence query over the block, written into ``o, lse``.

    Args:
        q: ``[B, Hkv, G, dk]`` (bf16/fp16; any strides with the last dim contiguous).
        kv: blocks ``[nb, parts, Hkv, D, dim]`` (block j at ``j * kv.stride(0)``), or with
            ``offsets`` any tensor whose first element is the base the offsets count from, with
            each block laid out as ``kv[0]`` is (``[parts, Hkv, D, dim]`` strides of ``kv.stride(1..4)``).
        parts: 2 (K and V) or 1 (MLA latent: V = the first ``dv`` key columns).
        dv: value width.
        scale: softmax scale.
        o, lse: ``[P, Hkv, G, dv]`` and ``[P, Hkv, G]`` float32: block j's partial goes to row
            ``out_base + j``.
        count: blocks to attend (default ``kv.shape[0]``, or ``len(offsets)``).
        offsets: ``[count]`` int64 element offsets of each block from ``kv``'s first element
            (plus ``layer_off``); None: consecutive blocks of ``kv``.
        seq: ``[P]`` int32 the sequence (row of q) of each output row: block j's is
            ``seq[out_base + j]``; None: block j is sequence j.
        lengths: ``[count]`` int32 valid keys of each block (0..D); None: all D.
        window: D when ``kv`` is not a block tensor (with ``offsets``).
        offsets_aligned: the caller guarantees every offset (plus ``layer_off``) is a multiple of 8
            elements, so the kernel's loads can be 16-byte vectors (without it, loads through
            offsets the compiler cannot see are scalar).
    """
    count = (kv.shape[0] if offsets is None else offsets.shape[0]) if count is None else count
    if count == 0:
        return
    B, Hkv, G, dk = q.shape
    D = kv.shape[3] if window is None else window
    tiles = _tiles(dk, dv, parts, G)
    st = kv.stride()
    v_off = 0 if parts == 1 else st[1]
    dummy = lse
    _blocks_kernel[(count, Hkv)](
        q, kv, offsets if offsets is not None else dummy, seq if seq is not None else dummy, lengths if lengths is not None else dummy,
        o, lse,
        layer_off, st[0], v_off, st[2], st[3],
        q.stride(0), q.stride(1), q.stride(2),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        out_base, scale, G, dk, dv, D,
        USE_OFF=offsets is not None, OFF_ALIGN=offsets is not None and offsets_aligned, HAS_SEQ=seq is not None, HAS_LEN=lengths is not None,
        **tiles,
    )


def merge_into(out: torch.Tensor, window: tuple[torch.Tensor, torch.Tensor], load: tuple[torch.Tensor, torch.Tensor] | None = None,
               starts: torch.Tensor | None = None, cpu: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Merge each sequence's partials by lse and write the output.

    Args:
        out: ``[B, Hkv * G, dv]`` (any float dtype; the last dim contiguous), written.
        window: ``(o [B, Hkv, G, dv], lse [B, Hkv, G])`` float32, one partial per sequence.
        load: ``(o [P, Hkv, G, dv], lse [P, Hkv, G])`` float32, sequence b's partials at rows
            ``starts[b] .. starts[b+1] - 1``; None: no load region this step.
        starts: ``[B + 1]`` int64, non-decreasing.
        cpu: ``(o [B, Hkv, G, dv], lse [B, Hkv, G])`` float32 (any strides, last dim
            contiguous), one per sequence; None: no CPU part.

    Returns:
        ``out``. Rows whose partials are all empty get 0; a NaN partial gives NaN (a failed CPU
        job is seen, not hidden).
    """
    o_w, l_w = window
    B, Hkv, G, dv = o_w.shape
    if B == 0:
        return out
    o_l, l_l = load if load is not None else window
    o_c, l_c = cpu if cpu is not None else window
    st = starts if starts is not None else l_w
    _merge_kernel[(B, Hkv)](
        o_w, l_w, o_l, l_l, st, o_c, l_c, out,
        o_w.stride(0), o_w.stride(1), o_w.stride(2), l_w.stride(0), l_w.stride(1),
        o_l.stride(0), o_l.stride(1), o_l.stride(2), l_l.stride(0), l_l.stride(1),
        o_c.stride(0), o_c.stride(1), o_c.stride(2), l_c.stride(0), l_c.stride(1),
        out.stride(0), out.stride(1),
        G, dv,
        HAS_LOAD=load is not None, HAS_CPU=cpu is not None,
        BLOCK_G=max(1, triton.next_power_of_2(G)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
    )
    return out
