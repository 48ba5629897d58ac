"""The interface between attention layers and a KV cache.

An attention layer hands the cache its new queries, keys and values; the cache writes the new
KV wherever its format puts it and returns attention over everything cached for each sequence.
Owning both the write and the read lets a partitioned cache (InplaceKVCache) route bytes at
write time and split attention across devices without the model knowing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from writescope.attention.metadata import ForwardBatch
from writescope.config import KVLayout


class KVCache(ABC):
    """Per-layer, per-sequence KV storage with attention over it.

    Lifecycle: ``allocate(capacity)`` -> slot id; forward passes call ``attend`` once per layer
    (or ``attend_begin`` then ``attend_end``); ``free(slot)`` returns the memory. ``seq_len(slot)``
    is the number of tokens written.

    Micro-batched decode (docs/DESIGN.md section 4): a cache whose decode has a CPU part may
    answer :meth:`decode_groups` with two or more contiguous ranges of the batch; the model then
    runs each layer once per range and issues range b's attention (``attend_begin``) before it
    finishes range a's (``attend_end``), so the CPU attends one range while the device runs the
    other's projections and experts. Caches that do not split return None and attend at once.
    """

    layout: KVLayout
    num_layers: int

    @abstractmethod
    def allocate(self, capacity: int, prompt_len: int = 0) -> int:
        """Reserve room for ``capacity`` tokens of one sequence in every layer; returns a slot id.

        ``prompt_len`` (tokens, 0 = unknown) lets a partitioned cache plan the prefill's placement.

        Raises:
            ValueError: capacity < 1.
            RuntimeError: the memory cannot be had (message names bytes asked and what to change).
        """

    @abstractmethod
    def free(self, slot: int) -> None:
        """Release a slot. Freeing an unknown slot is a no-op."""

    @property
    @abstractmethod
    def active_slots(self) -> list[int]:
        """Slots currently allocated."""

    @abstractmethod
    def seq_len(self, slot: int) -> int:
        """Tokens written for this slot (equal across layers after a full forward pass)."""

    @abstractmethod
    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        prefill_attn=None,
    ) -> torch.Tensor:
        """Write the new KV of this layer, then attend.

        Args:
            layer_id: 0 .. num_layers - 1.
            q: ``[T, q_heads, k_dim]`` packed new queries.
            k: ``[T, kv_heads, k_dim]`` new keys (MLA: the latent, kv_heads = 1).
            v: ``[T, kv_heads, v_dim]`` new values, or ``None`` when ``layout.shared_kv``.
            batch: ragged metadata; ``batch.context_lens[i]`` must equal what is cached.
            scale: softmax scale.
            sliding_window: see :func:`writescope.attention.attend_sequence`.
            prefill_attn: replaces :func:`~writescope.attention.attend_sequence` for a call
                that is not pure decode (some query length above 1): called per sequence as
                ``prefill_attn(q_rows, keys, vals, context_len, scale)`` with the cached + new
                KV in position order, returning ``[rows, q_heads, out_dim]``; the call then
                returns ``[T, q_heads, out_dim]`` (MLA's expanded prefill). Decode ignores it,
                and so does ``sliding_window`` (the hook attends everything it is given).

        Returns:
            ``[T, q_heads, v_dim]`` in q's dtype.
        """

    def attend_begin(self, layer_id, q, k, v, batch: ForwardBatch, scale, sliding_window=None, prefill_attn=None):
        """Issue this layer's attention; :meth:`attend_end` with the returned handle gives the
        output. Same arguments and errors as :meth:`attend`; this default attends at once."""
        return AttendedNow(self.attend(layer_id, q, k, v, batch, scale, sliding_window, prefill_attn))

    def attend_end(self, handle) -> torch.Tensor:
        """The output of an :meth:`attend_begin` call: ``[T, q_heads, v_dim]`` in q's dtype."""
        return handle.out

    def decode_groups(self, batch: ForwardBatch) -> list[tuple[int, int]] | None:
        """Contiguous ranges ``[(start, end), ...]`` of ``batch``'s sequences to run as separate
        micro-batches in this decode pass, or None to run it whole (this default)."""
        return None

    def abandon(self) -> None:
        """A forward pass stopped between ``attend_begin`` and ``attend_end`` (an error): wait
        for whatever the begun calls still read, so the caller may free what they use."""


class AttendedNow:
    """The handle :meth:`KVCache.attend_begin` returns for an attention computed at once (its
    output ready); caches that issue asynchronously return their own handles alongside it."""

    __slots__ = ("out",)

    def __init__(self, out: torch.Tensor):
        self.out = out
