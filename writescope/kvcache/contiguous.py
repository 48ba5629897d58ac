"""The plain KV cache: one preallocated tensor per sequence and layer, on one device."""

from __future__ import annotations

import torch

from writescope.attention.metadata import ForwardBatch
from writescope.attention.reference import attend_sequence
from writescope.config import KVLayout
from writescope.kvcache.base import KVCache


class ContiguousKVCache(KVCache):
    """K ``[capacity, kv_heads, k_dim]`` (+ V ``[capacity, kv_heads, v_dim]`` unless shared)
    per slot and layer, on ``device``, in ``dtype``.
    """

    def __init__(self, layout: KVLayout, num_layers: int, dtype: torch.dtype, device: torch.device | str):
        self.layout = layout
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        self._k: dict[int, list[torch.Tensor]] = {}
        self._v: dict[int, list[torch.Tensor]] = {}
        self._len: dict[int, list[int]] = {}
        self._next_slot = 0

    def bytes_for(self, capacity: int) -> int:
        """Bytes one sequence of ``capacity`` tokens takes across all layers."""
        return capacity * self.num_layers * self.layout.bytes_per_token(self.dtype.itemsize)

    def allocate(self, capacity: int, prompt_len: int = 0) -> int:
        if capacity < 1:
            raise ValueError(f"KV capacity must be at least 1 token, got {capacity}")
        lay = self.layout
        try:
            ks = [torch.empty(capacity, lay.kv_heads, lay.k_dim, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            vs = (
                []
                if lay.shared_kv
                else [torch.empty(capacity, lay.kv_heads, lay.v_dim, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            )
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"cannot allocate KV for {capacity} tokens ({self.bytes_for(capacity) / 2**30:.2f} GiB on {self.device}): "
                "lower the batch size, the prompt length or max_new_tokens"
            ) from e
        slot = self._next_slot
        self._next_slot += 1
        self._k[slot], self._v[slot], self._len[slot] = ks, vs, [0] * self.num_layers
        return slot

    def free(self, slot: int) -> None:
        for d in (self._k, self._v, self._len):
            d.pop(slot, None)

    def seq_len(self, slot: int) -> int:
        return self._len[slot][-1]

    @property
    def active_slots(self) -> list[int]:
        return list(self._k)

    def write(self, slot: int, layer_id: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Append one sequence's next tokens' KV without attending (fills a cache for benchmarks).

        Args:
            k: ``[n, kv_heads, k_dim]``; v: ``[n, kv_heads, v_dim]`` or None (shared latent).

        Raises:
            RuntimeError: the sequence would pass its capacity.
        """
        kc, n0, n = self._k[slot][layer_id], self._len[slot][layer_id], k.shape[0]
        if n0 + n > kc.shape[0]:
            raise RuntimeError(f"slot {slot} overflows its KV capacity {kc.shape[0]} tokens (needs {n0 + n})")
        kc[n0 : n0 + n] = k
        if not self.layout.shared_kv:
            self._v[slot][layer_id][n0 : n0 + n] = v
        self._len[slot][layer_id] = n0 + n

    def attend(self, layer_id, q, k, v, batch: ForwardBatch, scale, sliding_window=None, prefill_attn=None):
        lay = self.layout
        if all(n == 1 for n in batch.query_lens):
            prefill_attn = None  # decode (see KVCache.attend)
        out = q.new_empty(q.shape[0], q.shape[1], lay.v_dim) if prefill_attn is None else None
        for i, slot in enumerate(batch.slots):
            s, e = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            ctx = batch.context_lens[i]
            kc = self._k[slot][layer_id]
            assert self._len[slot][layer_id] == ctx, f"slot {slot} layer {layer_id}: cached {self._len[slot][layer_id]} != context {ctx}"
            if ctx + (e - s) > kc.shape[0]:
                raise RuntimeError(f"slot {slot} overflows its KV capacity {kc.shape[0]} tokens (needs {ctx + e - s})")
            kc[ctx : ctx + e - s] = k[s:e]
            if lay.shared_kv:
                keys = kc[: ctx + e - s]
                vals = keys[..., : lay.v_dim]
            else:
                vc = self._v[slot][layer_id]
                vc[ctx : ctx + e - s] = v[s:e]
                keys, vals = kc[: ctx + e - s], vc[: ctx + e - s]
            self._len[slot][layer_id] = ctx + e - s
            if e > s:
                if prefill_attn is None:
                    out[s:e] = attend_sequence(q[s:e], keys, vals, ctx, scale, sliding_window)
                else:
                    o = prefill_attn(q[s:e], keys, vals, ctx, scale)
                    out = q.new_empty(q.shape[0], q.shape[1], o.shape[-1]) if out is None else out
                    out[s:e] = o
        return out if out is not None else q.new_empty(q.shape[0], q.shape[1], lay.v_dim)
