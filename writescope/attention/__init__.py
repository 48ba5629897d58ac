"""Attention over the KV cache: the per-step metadata, the plain-torch attention, and the exact
log-sum-exp merge of partial results (``merge_states`` and its batched forms)."""

from writescope.attention.merge import merge_segments, merge_stacked, merge_states
from writescope.attention.metadata import ForwardBatch
from writescope.attention.reference import attend_sequence

__all__ = ["ForwardBatch", "attend_sequence", "merge_states", "merge_stacked", "merge_segments"]
