"""The four regions of one sequence, all layers, and its block table.

Per sequence (L layers, D = window, one block = ``[parts, kv_heads, D, dim]``):

```
D-window        device  [L, parts, kv_heads, D, dim]         newest tokens (win_len[l] of them)
compute region  host    [L, parts, kv_heads, cap, dim]       per-head rows; block c = rows c*D .. c*D+D-1
load region     host*   slabs [L, nblk, parts, kv_heads, D, dim]  one contiguous block each (*pinned on CUDA)
```

Blocks are numbered by position (block j = tokens j*D .. j*D + D - 1). ``homes[j]`` is the
(region, index in region) of block j, chosen once, when layer 0 places it; every other layer
places its block j at the same home. Nothing placed ever moves.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from writescope.kvcache import pinned
from writescope.kvcache.huge_pages import compute_empty
from writescope.kvcache.pinned import device_view, host_empty, unpin
from writescope.kvcache.prefill_writer import READ_BUFFERS, STAGING_BUFFERS
from writescope.kvcache.spec import PartitionSpec
from writescope.scheduler.policies import COMPUTE, LOAD, PlacementPolicy, prompt_plan, route_block

SLAB_MIN_BLOCKS = 16  # smallest load-region slab grown during decode (blocks)


@dataclass
class LoadSlab:
    """One registered host allocation holding load blocks ``first .. first + nblk - 1``."""

    tensor: torch.Tensor  # [L, nblk, parts, kv_heads, D, dim]
    first: int
    pinned: bool
    device_tensor: torch.Tensor | None = None  # the same bytes as a CUDA tensor (in-place reads), made on first use

    @property
    def nblk(self) -> int:
        return self.tensor.shape[1]


class SequenceKV:
    """Regions and block table of one sequence (see module docstring).

    Args:
        spec: the cache layout.
        capacity: tokens this sequence may reach (prompt + new tokens).
        prompt_len: P, for the prefill plan (0 = unknown: then the first write's length).
        policy: the placement policy routing this sequence's blocks.
        device: where the D-window lives.
        pin: register load-region slabs and staging with CUDA.
    """

    def __init__(self, spec: PartitionSpec, capacity: int, prompt_len: int, policy: PlacementPolicy, device: torch.device, pin: bool):
        self.spec, self.capacity, self.prompt_len, self.policy, self.pin = spec, capacity, prompt_len, policy, pin
        L, D = spec.num_layers, spec.window
        self.max_blocks = capacity // D
        # zeroed: masked window slots meet the value matmul with weight 0, which must not see NaN
        self.window = torch.zeros((L, *spec.block_shape()), dtype=spec.dtype, device=device)
        self.win_len = [0] * L
        self.placed = [0] * L  # tokens placed per layer (whole blocks)
        self.n_comp = [0] * L  # compute-region blocks per layer
        self.n_load = [0] * L  # load-region blocks per layer
        self.homes: list[tuple[int, int]] = []
        cpu_blocks = 0 if policy.max_cpu_share == 0 else self.max_blocks
        self.compute = compute_empty((L, spec.parts, spec.layout.kv_heads, cpu_blocks * D, spec.dim), spec.dtype)
        self.slabs: list[LoadSlab] = []
        self.staging: torch.Tensor | None = None  # pinned [L, parts, kv_heads, D, dim] for evictions to compute
        self.pending: list[tuple[object | None, int] | None] = [None] * L  # (CUDA event or None, compute block) awaiting copy-in
        self.evict_events: list[object | None] = [None] * L  # window reuse waits on these
        # chunked prefill's read-back waits on these, per layer, instead of on every copy in flight:
        self.load_written: list[object | None] = [None] * L  # CUDA event after the latest write into the layer's load blocks
        self.compute_writes: list[list] = [[] for _ in range(L)]  # the prefill writer's futures for the layer's compute rows
        # chunked prefill's reads of compute rows started ahead of their layer, by layer: (blocks read,
        # bytes, the prefill writer's read_async future) (kvcache/inplace.py, _read_ahead)
        self.read_ahead: dict[int, tuple[int, int, object]] = {}
        self._prompt_plan: list[int] | None = None  # regions of the prompt's whole blocks, decided once
        self._runs: tuple[int, list] | None = None  # (blocks, their block_runs) last asked for (block_runs)
        # what allocation did up front (seconds, bytes): the load blocks reserved (page-locked on
        # CUDA) and the compute rows committed; the cache sums them (InplaceKVCache.kv_allocation)
        self.reserve_s = self.commit_s = 0.0
        self.reserve_bytes = self.commit_bytes = 0
        if prompt_len > 0:  # reserve the prefill plan's load blocks now, so a shortfall shows at allocate
            plan = self.prompt_plan()
            if LOAD in plan:
                t0 = time.perf_counter()
                self._reserve_load(plan.count(LOAD))
                self.reserve_s = time.perf_counter() - t0
                self.reserve_bytes = sum(slab.tensor.numel() for slab in self.slabs) * spec.dtype.itemsize
            if COMPUTE in plan:  # fault in (commit) the prompt's compute rows now, not during prefill
                t0 = time.perf_counter()
                rows = self.compute[:, :, :, : plan.count(COMPUTE) * D]
                pinned.POOL.make_room(rows.numel() * rows.element_size())  # pageable: idle pinned buffers go first if short
                rows.zero_()
                self.commit_s = time.perf_counter() - t0
                self.commit_bytes = rows.numel() * rows.element_size()

    def block_runs(self, blocks: int) -> list[tuple[int, int, int, int]]:
        """:func:`block_runs` of the first ``blocks`` homes, kept until asked for another count
        (every layer of a chunk asks for the same one; homes only grow, so a kept count's runs
        stay right)."""
        kept = self._runs
        if kept is None or kept[0] != blocks:
            kept = self._runs = (blocks, block_runs(self.homes[:blocks]))
        return kept[1]

    # ------------------------------------------------------------------ lengths
    def seq_len(self, layer: int) -> int:
        return self.placed[layer] + self.win_len[layer]

    def comp_tokens(self, layer: int) -> int:
        return self.n_comp[layer] * self.spec.window

    # ------------------------------------------------------------------ routing
    def prompt_plan(self) -> list[int]:
        """Region of each whole block of the prompt, decided by the policy the first time it is
        asked (at ``allocate`` when the prompt length is known, else at the first write) and
        kept: an adaptive policy's later estimates change where new blocks go, never this plan."""
        if self.prompt_len == 0:
            return []  # not known yet
        if self._prompt_plan is None:
            D = self.spec.window
            self._prompt_plan = prompt_plan(self.policy, self.prompt_len, D)  # r asked once, not once a block
        return self._prompt_plan

    def home(self, block: int) -> tuple[int, int]:
        """(region, index) of ``block``; routed by the policy the first time it is asked."""
        if block < len(self.homes):
            return self.homes[block]
        assert block == len(self.homes), f"block {block} placed before block {len(self.homes)}"
        n_c = sum(1 for r, _ in self.homes if r == COMPUTE)
        plan = self.prompt_plan()
        region = plan[block] if block < len(plan) else route_block(self.policy, block, self.prompt_len, self.spec.window, n_c)
        assert region == LOAD or self.compute.shape[3] > 0, f"policy {self.policy} routed to the compute region with max_cpu_share 0"
        idx = n_c if region == COMPUTE else len(self.homes) - n_c
        if region == LOAD:
            self._reserve_load(idx + 1)
        self.homes.append((region, idx))
        return region, idx

    def _reserve_load(self, blocks: int) -> None:
        """Make room for ``blocks`` load blocks, growing by an exactly sized registered slab."""
        have = self.slabs[-1].first + self.slabs[-1].nblk if self.slabs else 0
        if blocks <= have:
            return
        cap = load_blocks_reserved(self.policy, self.max_blocks)
        want = max(blocks - have, min(cap - have, max(SLAB_MIN_BLOCKS, have)))
        s = self.spec
        t = host_empty((s.num_layers, want, *s.block_shape()), s.dtype, self.pin)
        self.slabs.append(LoadSlab(t, have, self.pin))

    def load_block(self, layer: int, idx: int) -> torch.Tensor:
        """The load block ``idx`` of ``layer``: ``[parts, kv_heads, D, dim]`` (contiguous)."""
        for slab in self.slabs:
            if slab.first <= idx < slab.first + slab.nblk:
                return slab.tensor[layer, idx - slab.first]
        raise AssertionError(f"load block {idx} has no slab")

    def load_runs(self, layer: int, start: int, stop: int, max_blocks: int, device: torch.device | None = None) -> list[torch.Tensor]:
        """Load blocks ``start .. stop - 1`` of ``layer`` as contiguous runs of at most
        ``max_blocks`` blocks: each ``[nb, parts, kv_heads, D, dim]``, one copy each. With a CUDA
        ``device``: the same runs as CUDA tensors over the page-locked host bytes, for kernels
        that read the load region in place (:func:`writescope.kvcache.pinned.device_view`)."""
        runs = []
        for slab in self.slabs:
            a, b = max(start, slab.first), min(stop, slab.first + slab.nblk)
            src = slab.tensor
            if device is not None and device.type == "cuda":
                if slab.device_tensor is None:
                    slab.device_tensor = device_view(slab.tensor, device)
                src = slab.device_tensor
            for s in range(a, b, max_blocks):
                e = min(b, s + max_blocks)
                runs.append(src[layer, s - slab.first : e - slab.first])
        return runs

    def load_slab_runs(self, stop: int, device: torch.device) -> list[tuple[torch.Tensor, int, int]]:
        """Load blocks ``0 .. stop - 1`` (every layer alike) as ``(slab, lo, hi)``: blocks ``lo ..
        hi - 1`` of ``slab`` ``[L, nblk, parts, kv_heads, D, dim]``, a CUDA view of the pinned slab
        on a CUDA ``device`` (else the slab itself), in block order."""
        out = []
        for slab in self.slabs:
            a, b = 0, min(stop, slab.first + slab.nblk) - slab.first
            if b <= a:
                continue
            t = slab.tensor
            if device.type == "cuda":
                if slab.device_tensor is None:
                    slab.device_tensor = device_view(slab.tensor, device)
                t = slab.device_tensor
            out.append((t, a, b))
        return out

    def compute_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K ``[kv_heads, n, dk]`` and V ``[kv_heads, n, dv]`` views of the placed compute region."""
        n, reg = self.comp_tokens(layer), self.compute[layer]
        k = reg[0, :, :n]
        v = reg[1, :, :n] if self.spec.parts == 2 else k[..., : self.spec.layout.v_dim]
        return k, v

    def staging_buffer(self) -> torch.Tensor:
        if self.staging is None:
            self.staging = host_empty(tuple(self.window.shape), self.spec.dtype, self.pin)
        return self.staging

    def drain(self, layer: int) -> None:
        """Finish a pending eviction to the compute region: wait for its device-to-host copy
        into the pinned staging block, then write the block to its home (CPU copy)."""
        p = self.pending[layer]
        if p is None:
            return
        event, idx = p
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
        D = self.spec.window
        self.compute[layer, :, :, idx * D : (idx + 1) * D].copy_(self.staging[layer])  # type: ignore[index]
        self.pending[layer] = None

    # ------------------------------------------------------------------ lifecycle
    def release(self) -> None:
        """Unregister pinned memory (the caller has synchronised pending copies)."""
        for slab in self.slabs:
            slab.device_tensor = None
            if slab.pinned:
                unpin(slab.tensor)
        if self.staging is not None and self.pin:
            unpin(self.staging)
        self.slabs, self.staging = [], None

    def check_invariants(self) -> None:
        """Raise AssertionError unless the block table and counts are consistent.

        Every token position lives in exactly one region: tokens 0 .. placed[l]-1 in whole
        blocks (block j at ``homes[j]``), tokens placed[l] .. seq_len-1 in the D-window; each
        region index is used by exactly one block; per-layer region counts add up.
        """
        D = self.spec.window
        comp_idx = [i for r, i in self.homes if r == COMPUTE]
        load_idx = [i for r, i in self.homes if r == LOAD]
        assert comp_idx == list(range(len(comp_idx))), f"compute indices not 0..n-1: {comp_idx}"
        assert load_idx == list(range(len(load_idx))), f"load indices not 0..n-1: {load_idx}"
        assert not load_idx or self.slabs and self.slabs[-1].first + self.slabs[-1].nblk >= len(load_idx), "load block without slab"
        assert len(comp_idx) * D <= self.compute.shape[3], "compute region overflow"
        for layer in range(self.spec.num_layers):
            nb = self.placed[layer] // D
            assert self.placed[layer] % D == 0, f"layer {layer}: placed {self.placed[layer]} not whole blocks"
            assert nb <= len(self.homes), f"layer {layer}: {nb} blocks placed but {len(self.homes)} homed"
            assert 0 <= self.win_len[layer] <= D, f"layer {layer}: window holds {self.win_len[layer]} > D"
            homes = self.homes[:nb]
            assert self.n_comp[layer] == sum(r == COMPUTE for r, _ in homes), f"layer {layer}: compute count"
            assert self.n_load[layer] == sum(r == LOAD for r, _ in homes), f"layer {layer}: load count"
            assert self.n_comp[layer] + self.n_load[layer] == nb, f"layer {layer}: region counts do not add up"
            assert self.seq_len(layer) <= self.capacity, f"layer {layer}: {self.seq_len(layer)} tokens > capacity"



def pinned_staging_bytes(spec: PartitionSpec, policy: PlacementPolicy, batch: int, host_kv: int) -> int:
    """Pinned staging a batch needs besides the load region: eviction staging (one block per
    layer and sequence) and the prefill writer's staging buffers (writes and chunked prefill's
    read-back) when anything goes to the compute region,
    plus the monolithic baseline's two re-layout buffers of up to one layer's KV (``host_kv`` is
    the batch's spilled KV in bytes, all layers)."""
    staging = spec.staging_bytes(batch) + (STAGING_BUFFERS + READ_BUFFERS) * spec.pingpong_blocks * spec.block_bytes if policy.max_cpu_share > 0 else 0
    if getattr(policy, "monolithic", False):
        staging += 2 * host_kv // spec.num_layers
    return staging


def load_blocks_reserved(policy: PlacementPolicy, max_blocks: int) -> int:
    """Most load-region blocks a sequence of ``max_blocks`` whole blocks reserves under ``policy``
    (its largest load share, +2 for the rounding of the prefill plan and of decode routing)."""
    return 0 if policy.max_load_share == 0 else min(max_blocks, math.ceil(policy.max_load_share * max_blocks) + 2)


def block_runs(homes: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """The runs of ``homes`` (each block's ``(region, index)``, in sequence order) whose blocks are
    consecutive both in the sequence and in their region: ``(region, first index, first block,
    blocks)`` each, in sequence order. A prompt plan gives two runs (its load blocks and its
    compute blocks); decode's evictions, which alternate regions, one run per change.

    >>> block_runs([(1, 0), (1, 1), (0, 0), (0, 1), (1, 2)])
    [(1, 0, 0, 2), (0, 0, 2, 2), (1, 2, 4, 1)]
    """
    runs: list[tuple[int, int, int, int]] = []
    for block, (region, idx) in enumerate(homes):
        if runs:
            r, first, start, n = runs[-1]
            if r == region and first + n == idx:
                runs[-1] = (r, first, start, n + 1)
                continue
        runs.append((region, idx, block, 1))
    return runs
