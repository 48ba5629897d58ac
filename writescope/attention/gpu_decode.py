"""The GPU side of one decode layer through the Triton kernels (attention/gpu_kernel.py).

Per layer: one launch for the D-windows of all sequences (read in place through offsets from
one base, no stack), one launch per ping-pong fill of load-region blocks, one merge launch that
also takes the CPU partial and writes the output in q's dtype. Everything a launch needs besides
q and the blocks (window offsets and lengths, each fill block's sequence, each sequence's range
of partials, the partial buffers) is built once per step: it is the same for every layer of a
step (every layer appends the same token, and block j of every layer has the same home), so
:class:`StepPlan` is kept while its signature (window addresses and lengths, the runs of load
blocks) is unchanged, and layers after the first issue no host-to-device copy of metadata. A
micro-batched step (models/causal_lm.py) has one plan per micro-batch: the last ``MAX_PLANS``
are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from writescope.attention import gpu_kernel


MAX_PLANS = 2  # plans kept: one per micro-batch of a step (models/decode_step.py runs at most two)


@dataclass
class StepPlan:
    """Device metadata and partial buffers of one step's layers (see module docstring)."""

    signature: tuple
    win_off: torch.Tensor  # [B] int64 element offsets of each window from the base window
    win_len: torch.Tensor  # [B] int32
    blk_seq: torch.Tensor | None  # [P] int32 sequence of each load partial
    starts: torch.Tensor | None  # [B + 1] int64 each sequence's range of load partials
    o_w: torch.Tensor  # [B, Hkv, G, dv] float32
    l_w: torch.Tensor  # [B, Hkv, G]
    o_l: torch.Tensor | None  # [P, Hkv, G, dv] float32
    l_l: torch.Tensor | None
    window_tokens: int
    load_base: torch.Tensor | None = None  # in place: the block tensor the offsets count from
    load_offs: torch.Tensor | None = None  # in place: [L, P] int64 element offsets of every layer's load blocks
    win_aligned: bool = False  # every window offset (and layer stride) a multiple of 8 elements
    load_aligned: bool = False  # every load offset a multiple of 8 elements


class GpuDecode:
    """Window, load-region and merge launches of a :class:`~writescope.attention.split.SplitDecoder`
    on CUDA (bf16/fp16 caches), with the step plan cached across layers."""

    def __init__(self, spec, device: torch.device):
        self.spec, self.device = spec, device
        self.cuda = device.type == "cuda"
        self.plans: dict[tuple, StepPlan] = {}  # by signature, the newest last: one per micro-batch of the step
        self.plans_built = 0  # how many times metadata was built and copied (tests: once per step and micro-batch)
        self._offsets: tuple | None = None  # (load table signature, (base, offsets, aligned)) of the in-place read

    def step_plan(self, layer: int, qg: torch.Tensor, seqs: list, load_runs: list[tuple[int, int]], in_place: list | None = None) -> StepPlan:
        """The plan for this layer: the cached one when the signature matches, else a new one.

        Args:
            qg: ``[B, Hkv, G, dk]``.
            seqs: the batch's SequenceKV.
            load_runs: ``(sequence index, blocks)`` of every load-region source, in order.
            in_place: the load region read in place: ``(sequence index, slab, lo, hi)`` per run,
                the same runs as ``load_runs`` (slab ``[L, nblk, ...]`` a device view; blocks lo..hi-1):
                the plan then holds every layer's block offsets for one launch per layer.
        """
        base = seqs[0].window
        table_sig = None if in_place is None else tuple((i, t.data_ptr(), t.stride(0), lo, hi) for i, t, lo, hi in in_place)
        sig = (tuple((sq.window.data_ptr(), sq.win_len[layer]) for sq in seqs), tuple(load_runs), table_sig, qg.shape, qg.dtype)
        hit = self.plans.pop(sig, None)
        if hit is not None:
            self.plans[sig] = hit  # the newest again
            return hit
        B, Hkv, G, _ = qg.shape
        dv, item = self.spec.layout.v_dim, base.element_size()
        offs = [(sq.window.data_ptr() - base.data_ptr()) // item for sq in seqs]
        lens = [sq.win_len[layer] for sq in seqs]
        P = sum(n for _, n in load_runs)
        seq_of, starts = [], [0] * (B + 1)
        for i, n in load_runs:
            seq_of += [i] * n
            starts[i + 1] += n
        for b in range(B):
            starts[b + 1] += starts[b]
        assert all(seq_of[j] <= seq_of[j + 1] for j in range(len(seq_of) - 1)), "load runs must come in sequence order"
        # one copy per integer width, each array starting 16-byte aligned (Triton specialises on a
        # pointer's alignment: an unaligned slice would compile another variant mid-step); the
        # partial ranges in int64, so the merge's row offsets cannot wrap
        pad = lambda xs, n: xs + [0] * (-len(xs) % n)  # noqa: E731
        a = len(pad(lens, 4))
        c = len(pad(offs, 2))
        small = torch.tensor(pad(offs, 2) + starts, dtype=torch.int64), torch.tensor(pad(lens, 4) + seq_of, dtype=torch.int32)
        if self.cuda:
            small = tuple(t.pin_memory().to(self.device, non_blocking=True) for t in small)
        wide, ints = small
        f32 = dict(dtype=torch.float32, device=self.device)
        plan = StepPlan(
            signature=sig, win_off=wide[:B], win_len=ints[:B], blk_seq=ints[a : a + P] if P else None,
            starts=wide[c:] if P else None,
            o_w=torch.empty(B, Hkv, G, dv, **f32), l_w=torch.empty(B, Hkv, G, **f32),
            o_l=torch.empty(P, Hkv, G, dv, **f32) if P else None, l_l=torch.empty(P, Hkv, G, **f32) if P else None,
            window_tokens=sum(lens),
        )
        plan.win_aligned = all(o % 8 == 0 for o in offs) and base.stride(0) % 8 == 0
        if in_place and P:
            plan.load_base, plan.load_offs, plan.load_aligned = self._load_offsets(table_sig, in_place)
        self.plans_built += 1
        self.plans[sig] = plan
        while len(self.plans) > MAX_PLANS:  # the oldest: an earlier step's (its buffers are reused in stream order)
            self.plans.pop(next(iter(self.plans)))
        return plan

    def _load_offsets(self, sig: tuple, table: list) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``(base, offsets [L, P], aligned)``: block j of layer l of the runs in ``table`` lies
        ``offsets[l, j]`` elements from ``base``'s first (all slabs share the block layout, so one
        base addresses them all through unified addressing); ``aligned``: all multiples of 8.
        Kept for the table's signature ``sig`` (a plan is rebuilt every step as the windows grow;
        the load blocks change only at evictions)."""
        if self._offsets is not None and self._offsets[0] == sig:
            return self._offsets[1]
        base = table[0][1][0]  # [nblk, parts, Hkv, D, dim]: layer 0 of the first slab
        item, bptr = base.element_size(), base.data_ptr()
        off0, lstride = [], []
        for _, t, lo, hi in table:
            p0, bs, ls = (t.data_ptr() - bptr) // item, t.stride(1), t.stride(0)
            off0 += [p0 + b * bs for b in range(lo, hi)]
            lstride += [ls] * (hi - lo)
        L, P = self.spec.num_layers, len(off0)
        pad = P % 2  # rows of an even length: every layer's row starts 16-byte aligned (one Triton variant)
        offs = torch.tensor(off0 + [0] * pad, dtype=torch.int64)[None, :] + torch.arange(L, dtype=torch.int64)[:, None] * torch.tensor(
            lstride + [0] * pad, dtype=torch.int64)[None, :]
        aligned = all(o % 8 == 0 for o in off0) and all(x % 8 == 0 for x in lstride)
        if self.cuda:
            offs = offs.pin_memory().to(self.device, non_blocking=True)
        self._offsets = (sig, (base, offs[:, :P], aligned))
        return self._offsets[1]

    def forget(self) -> None:
        """Drop the cached plans and load offsets (they hold views of sequences' memory): call when
        a sequence is freed, after the device is done with it."""
        self.plans.clear()
        self._offsets = None

    def load_in_place(self, plan: StepPlan, qg: torch.Tensor, layer: int, scale: float) -> None:
        """Every load block of this layer, read in place over PCIe, one launch, into ``plan.o_l, plan.l_l``."""
        gpu_kernel.block_partials_into(qg, plan.load_base, self.spec.parts, self.spec.layout.v_dim, scale, plan.o_l, plan.l_l,
                                       offsets=plan.load_offs[layer], seq=plan.blk_seq, window=self.spec.window,
                                       offsets_aligned=plan.load_aligned)

    def windows(self, plan: StepPlan, layer: int, qg: torch.Tensor, seqs: list, scale: float) -> None:
        """The window partials of all sequences, one launch, into ``plan.o_w, plan.l_w``."""
        base = seqs[0].window
        gpu_kernel.block_partials_into(qg, base, self.spec.parts, self.spec.layout.v_dim, scale, plan.o_w, plan.l_w,
                                       offsets=plan.win_off, layer_off=layer * base.stride(0), lengths=plan.win_len,
                                       window=self.spec.window, offsets_aligned=plan.win_aligned)

    def fill(self, plan: StepPlan, qg: torch.Tensor, buf: torch.Tensor, start: int, scale: float) -> None:
        """Partials of the ``buf.shape[0]`` blocks of one ping-pong fill ``buf`` ``[nb, parts,
        Hkv, D, dim]``, whose first block is load partial ``start``."""
        gpu_kernel.block_partials_into(qg, buf, self.spec.parts, self.spec.layout.v_dim, scale, plan.o_l, plan.l_l,
                                       out_base=start, seq=plan.blk_seq)

    def merge(self, plan: StepPlan, q: torch.Tensor, cpu: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Window + load + CPU partials merged: ``[B, q_heads, dv]`` in q's dtype."""
        B, Hq, _ = q.shape
        out = torch.empty(B, Hq, self.spec.layout.v_dim, dtype=q.dtype, device=self.device)
        load = (plan.o_l, plan.l_l) if plan.o_l is not None else None
        return gpu_kernel.merge_into(out, (plan.o_w, plan.l_w), load, plan.starts, cpu)

    def warm_up(self, q_heads: int, dtype: torch.dtype) -> None:
        """Compile every kernel variant a decode step uses (windows, fills, merges with and without
        load and CPU partials) on one block of the real shape, so no compile lands in a step."""
        s = self.spec
        Hkv, dk, dv = s.layout.kv_heads, s.layout.k_dim, s.layout.v_dim
        G = q_heads // Hkv
        dev = self.device
        q = torch.zeros(1, Hkv, G, dk, dtype=dtype, device=dev)
        blk = torch.zeros(1, *s.block_shape(), dtype=s.dtype, device=dev)
        o, l = torch.empty(1, Hkv, G, dv, dtype=torch.float32, device=dev), torch.empty(1, Hkv, G, dtype=torch.float32, device=dev)
        ints = torch.zeros(4, dtype=torch.int32, device=dev)
        starts = torch.zeros(2, dtype=torch.int64, device=dev)
        zero_off = torch.zeros(2, dtype=torch.int64, device=dev)[:1]
        for aligned in (False, True):  # the windows (offsets and lengths), and the in-place load read (offsets and sequences)
            gpu_kernel.block_partials_into(q, blk, s.parts, dv, 1.0, o, l, offsets=zero_off, lengths=ints[:1], window=s.window,
                                           offsets_aligned=aligned)
            if s.load_read == "in-place":
                gpu_kernel.block_partials_into(q, blk, s.parts, dv, 1.0, o, l, offsets=zero_off, seq=ints, window=s.window,
                                               offsets_aligned=aligned)
        gpu_kernel.block_partials_into(q, blk, s.parts, dv, 1.0, o, l, seq=ints)
        out = torch.empty(1, q_heads, dv, dtype=dtype, device=dev)
        for load in (None, (o, l)):
            for cpu in (None, (o.clone(), l.clone())):
                gpu_kernel.merge_into(out, (o, l), load, starts if load is not None else None, cpu)
