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

    Lifecycle: ``allocate(capacity)`` -> slot id; forward passes call ``attend`` once per layer;
    ``free(slot)`` returns the memory. ``seq_len(slot)`` is the number of tokens written.
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
