"""Streaming host experts to the GPU for long prompts (docs/DESIGN.md section 6; issue: budget).

A routed expert in host memory gets few tokens in decode, many in a prefill chunk. For many
tokens the CPU's GEMMs are far slower than copying the weights over: on the H200 machine a bf16 expert GEMM runs at 1.3-1.7 TFLOP/s on 16 cores and the
pinned host-to-device copy at 55 GB/s (docs/HARDWARE.md). Computing n tokens of an expert with
D x I weights costs 6 D I n FLOPs; copying the weights costs 6 D I bytes (bf16, three matrices),
so copying wins from n ~ 1.5e12 / 55e9 ~ 27 tokens. Experts with at least ``min_tokens`` (32)
assigned tokens are streamed. Of the rest, ``SparseMoeBlock.stream_share`` are streamed too and
the CPU computes the others: on the H200 the CPU's few-token GEMMs read weights at only 9-27 GB/s,
so streaming all of them (share 1, the default on CUDA) was 1.6-5.3x faster for a 16-token decode
batch (benchmarks/results/e2e.md, "Expert phase").

Streamed experts go through ``2 x slots`` device weight slots shared by all layers (double
buffered: the copy of the next group runs on a copy stream while the current group computes),
and are computed as grouped GEMMs like the device experts. The slots are part of the memory plan
(writescope.budget.plan: ``stream_slots``).
"""

from __future__ import annotations

import weakref

import torch

from writescope.moe.grouped import grouped_swiglu

MIN_TOKENS = 32  # assigned tokens from which an expert is streamed rather than computed on the CPU
SLOTS = 4  # experts per slot group (two groups: double buffering)

_SLOTS: "weakref.WeakValueDictionary[tuple, WeightSlots]" = weakref.WeakValueDictionary()  # freed with the last block holding them


class WeightSlots:
    """Two groups of ``slots`` expert weight slots on ``device`` (``w13 [2, S, 2I, D]``, ``w2
    [2, S, D, I]``), shared by every block of one shape, with the events that order their reuse."""

    def __init__(self, device: torch.device, dtype: torch.dtype, hidden: int, inter: int, slots: int):
        with torch.inference_mode(False):  # normal tensors: written in place in and out of inference mode
            self.w13 = torch.empty(2, slots, 2 * inter, hidden, dtype=dtype, device=device)
            self.w2 = torch.empty(2, slots, hidden, inter, dtype=dtype, device=device)
        self.slots = slots
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.free: list[object | None] = [None, None]  # event: the group's last reader is done

    @staticmethod
    def for_shape(device: torch.device, dtype: torch.dtype, hidden: int, inter: int, slots: int | None = None) -> "WeightSlots":
        slots = slots or SLOTS
        key = (str(device), dtype, hidden, inter, slots)
        ws = _SLOTS.get(key)
        if ws is None:
            ws = _SLOTS[key] = WeightSlots(device, dtype, hidden, inter, slots)
        return ws

    def nbytes(self) -> int:
        return self.w13.numel() * self.w13.element_size() + self.w2.numel() * self.w2.element_size()


def default_stream_share(device: torch.device) -> float:
    """The decode stream share when none is given: 1 (stream every host expert) on CUDA, 0
    without CUDA, where the "device" is the CPU itself (benchmarks/results/e2e.md, "Expert phase")."""
    return 1.0 if device.type == "cuda" else 0.0


def stream_plan_bytes(hidden: int, inter: int, itemsize: int, slots: int | None = None) -> int:
    """Device bytes of the weight slots (both groups) for experts of ``hidden`` x ``inter``."""
    return 2 * (slots or SLOTS) * 3 * hidden * inter * itemsize


def run_streamed(host_pack, experts: list[int], rows: list[torch.Tensor], weights: list[torch.Tensor], x: torch.Tensor, out: torch.Tensor) -> None:
    """Compute host experts ``experts`` on ``x``'s device by streaming their weights.

    Args:
        host_pack: the block's host experts packed (``PackedExperts`` with ``pin``): ``w13``,
            ``w2`` and ``ids`` (expert id per packed slot).
        experts: expert ids to stream; rows[i] ``[n_i]`` int64 (device) the token rows of
            expert i, weights[i] ``[n_i]`` float32 (device) their routing weights.
        x: ``[T, D]`` tokens; out: ``[T, D]`` accumulated into (float32, or x's dtype).
    """
    D, I = host_pack.hidden, host_pack.inter
    ws = WeightSlots.for_shape(x.device, x.dtype, D, I)
    host_pack.slots = ws  # the block keeps the slots alive (they go with the last block using them)
    index = host_pack.index
    cur = torch.cuda.current_stream(x.device) if ws.cuda else None
    starts = range(0, len(experts), ws.slots)  # group g is experts[starts[g] : starts[g] + slots]
    groups = [experts[a : a + ws.slots] for a in starts]
    # every group's offsets in one small host-to-device copy before the loop, from pinned memory,
    # so no copy inside the loop waits for the stream
    ends = []
    for a in starts:
        run = 0
        for r in rows[a : a + ws.slots]:
            run += r.numel()
            ends.append(run)
    offs_all = torch.tensor(ends, dtype=torch.int32)
    offs_all = (offs_all.pin_memory() if ws.cuda else offs_all).to(x.device, non_blocking=True)
    ready = _issue_copy(ws, host_pack, index, groups[0], 0, cur)
    for g, group in enumerate(groups):
        b = g % 2
        nxt = _issue_copy(ws, host_pack, index, groups[g + 1], (g + 1) % 2, cur) if g + 1 < len(groups) else None
        if ready is not None:
            cur.wait_event(ready)
        first, n = starts[g], len(group)
        tok = torch.cat(rows[first : first + n])
        w = torch.cat(weights[first : first + n]).to(x.dtype)
        offs = offs_all[first : first + n]
        y = grouped_swiglu(x[tok], ws.w13[b, :n], ws.w2[b, :n], offs, I)
        out.index_add_(0, tok, y.mul_(w[:, None]).to(out.dtype))
        if ws.cuda:
            done = torch.cuda.Event()
            done.record(cur)
            ws.free[b] = done
        ready = nxt


def _issue_copy(ws: WeightSlots, host_pack, index: dict[int, int], group: list[int], b: int, cur):
    """Copy ``group``'s weights into slot group ``b``; returns the event to wait for (None without CUDA)."""
    if not ws.cuda:
        for i, e in enumerate(group):
            ws.w13[b, i].copy_(host_pack.w13[index[e]])
            ws.w2[b, i].copy_(host_pack.w2[index[e]])
        return None
    with torch.cuda.stream(ws.copy_stream):
        if ws.free[b] is not None:
            ws.copy_stream.wait_event(ws.free[b])  # the group's previous readers are done
        for i, e in enumerate(group):
            ws.w13[b, i].copy_(host_pack.w13[index[e]], non_blocking=True)
            ws.w2[b, i].copy_(host_pack.w2[index[e]], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(ws.copy_stream)
    return ev
