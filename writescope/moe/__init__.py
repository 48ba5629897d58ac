"""Mixture-of-experts: the fp32 router and the sparse expert block."""

from writescope.moe.block import SparseMoeBlock
from writescope.moe.router import route

__all__ = ["SparseMoeBlock", "route"]
