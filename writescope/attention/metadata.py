"""What one forward pass computes, per sequence.

Vocabulary (as in vLLM): for sequence i of a ragged batch,

```
 cached tokens (context_lens[i])   new tokens this pass (query_lens[i])
 |------------------------------|--------------------|
 0                     context_lens[i]        context_lens[i] + query_lens[i] = seq_lens[i]
```

New tokens of all sequences are packed along one token axis T = sum(query_lens), in batch
order; ``query_start_loc[i]`` is where sequence i's tokens start. Prefill has
context_lens = 0 (or > 0 for later chunks of a chunked prefill); decode has query_lens = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ForwardBatch:
    """Metadata of one forward pass over a ragged batch.

    Attributes:
        slots: cache slot id of each sequence, ``len == batch``.
        query_lens: new tokens per sequence (tokens).
        context_lens: tokens already cached per sequence before this pass (tokens).
        positions: ``[T]`` int64 absolute position of every packed token, on the model device.
    """

    slots: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    positions: torch.Tensor
    query_start_loc: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        assert len(self.slots) == len(self.query_lens) == len(self.context_lens), "ragged metadata lengths differ"
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        object.__setattr__(self, "query_start_loc", tuple(starts))
        assert self.positions.shape == (starts[-1],), f"positions {tuple(self.positions.shape)} != [{starts[-1]}]"

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens))

    @staticmethod
    def build(slots, query_lens, context_lens, device: torch.device | str) -> "ForwardBatch":
        """Metadata with positions ``context_len .. context_len + query_len - 1`` per sequence."""
        pos = [torch.arange(c, c + q, dtype=torch.long) for c, q in zip(context_lens, query_lens)]
        positions = torch.cat(pos) if pos else torch.empty(0, dtype=torch.long)
        return ForwardBatch(tuple(slots), tuple(query_lens), tuple(context_lens), positions.to(device))

    def sub(self, start: int, end: int) -> "ForwardBatch":
        """The metadata of sequences ``start .. end - 1`` alone (a micro-batch); its tokens are
        packed rows ``query_start_loc[start] .. query_start_loc[end] - 1`` of this batch."""
        a, b = self.query_start_loc[start], self.query_start_loc[end]
        return ForwardBatch(self.slots[start:end], self.query_lens[start:end], self.context_lens[start:end], self.positions[a:b])

    def last_token_indices(self) -> list[int]:
        """Packed index of each sequence's last new token (where next-token logits come from)."""
        return [s - 1 for s in self.query_start_loc[1:]]
