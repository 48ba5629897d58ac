"""Attention over the KV cache: the per-step metadata and the plain-torch attention."""

from writescope.attention.metadata import ForwardBatch
from writescope.attention.reference import attend_sequence

__all__ = ["ForwardBatch", "attend_sequence"]
