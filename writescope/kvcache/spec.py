"""``PartitionSpec``: the physical layout of InplaceKVCache for one model, and region sizing.

One block is D tokens of one layer: ``[parts, kv_heads, D, dim]`` with parts = 2 (K and V,
``dim = head_dim``) or, for MLA, parts = 1 (the 512 + 64 latent, ``dim = 576``; V is its first
512 values). The D-window has the shape of one block; a load-region block is one block, stored
contiguously; the compute region stores ``[parts, kv_heads, tokens, dim]`` so each head's rows are
contiguous (docs/DESIGN.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from writescope.config import KVLayout
from writescope.env import env_choice, env_int

DEFAULT_WINDOW = 256  # D, tokens (docs/DESIGN.md section 3)
DEFAULT_PINGPONG_BYTES = 64 * 2**20  # bytes per ping-pong buffer
DEFAULT_PINGPONG_BUFFERS = 2
PINGPONG_ENV = "WRITESCOPE_PINGPONG_BUFFERS"


LOAD_READ_ENV = "WRITESCOPE_LOAD_READ"
LOAD_READS = ("copy", "in-place")


def load_read_from_env() -> str:
    """``WRITESCOPE_LOAD_READ``: how the GPU reads the load region in a decode step. ``copy`` (the
    default): copied over PCIe into the ping-pong buffers on a copy stream, then attended there;
    ``in-place``: the attention kernels read the page-locked blocks where they lie (unified
    addressing), with no ping-pong buffers (their device memory goes to the budget) and no copy
    stream.

    Raises:
        ValueError: another value (names it and the choices).
    """
    return env_choice(LOAD_READ_ENV, LOAD_READS)


def pingpong_buffers_from_env() -> int:
    """``WRITESCOPE_PINGPONG_BUFFERS``: how many ping-pong buffers the load region streams through
    (default 2). More let the copies of layer l+1's blocks run on while layer l waits for its CPU
    part (a ring of about one layer's load blocks decouples the link from that wait), at
    ``DEFAULT_PINGPONG_BYTES`` of device memory each, counted in the budget.

    Raises:
        ValueError: not an integer from 1 to 64 (names the value).
    """
    n = env_int(PINGPONG_ENV, 1, 64, f"use an integer from 1 to 64 (default {DEFAULT_PINGPONG_BUFFERS})")
    return DEFAULT_PINGPONG_BUFFERS if n is None else n


@dataclass(frozen=True)
class Roofline:
    """Inputs of r(L) (docs/DESIGN.md section 5): A, B in seconds per token; C_cpu, C_gpu in seconds.

    The split check (optional; None or 0 leaves the paper's r(L) as it is): ``b_alone`` and
    ``c_gpu_alone`` give the wall time of a step that streams everything with no CPU part,
    ``b_alone * L + c_gpu_alone`` (seconds per token, seconds), and ``c_split`` the seconds a split
    step takes beyond the slower of its two sides (handing q to the CPU, waiting for it, moving its
    partial, the merge). :class:`~writescope.scheduler.roofline.WriteScopePolicy` keeps r = 0 where
    the split step is predicted no faster than streaming alone.
    """

    a: float
    b: float
    c_cpu: float = 0.0
    c_gpu: float = 0.0
    b_alone: float | None = None
    c_gpu_alone: float | None = None
    c_split: float = 0.0


@dataclass(frozen=True)
class PartitionSpec:
    """Layout and sizes of an InplaceKVCache.

    Attributes:
        layout: KV shape of the model (:attr:`writescope.config.ModelConfig.kv_layout`).
        num_layers: layers with a KV cache.
        dtype: element type of all regions.
        window: D, tokens per D-window and per block (default 256).
        pingpong_buffers: GPU buffers the load region streams through (>= 2 for overlap; default
            ``WRITESCOPE_PINGPONG_BUFFERS`` or 2).
        pingpong_bytes: bytes per ping-pong buffer; rounded down to whole blocks (at least one).
        load_read: ``copy`` or ``in-place`` (default ``WRITESCOPE_LOAD_READ`` or ``copy``): see
            :func:`load_read_from_env`.
        roofline: calibrated A, B, C (the scheduler issue fills it; unused by static policies).

    Raises:
        ValueError: window < 1, pingpong_buffers < 1 (or a bad ``WRITESCOPE_PINGPONG_BUFFERS``), or GQA keys and
            values of unequal width.
    """

    layout: KVLayout
    num_layers: int
    dtype: torch.dtype
    window: int = DEFAULT_WINDOW
    pingpong_buffers: int = field(default_factory=pingpong_buffers_from_env)
    load_read: str = field(default_factory=load_read_from_env)
    pingpong_bytes: int = DEFAULT_PINGPONG_BYTES
    roofline: Roofline | None = None

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window D must be >= 1 token, got {self.window}")
        if self.pingpong_buffers < 1:
            raise ValueError(f"pingpong_buffers must be >= 1, got {self.pingpong_buffers}")
        if self.load_read not in LOAD_READS:
            raise ValueError(f"load_read must be one of {', '.join(LOAD_READS)}, got {self.load_read!r}")
        if not self.layout.shared_kv and self.layout.k_dim != self.layout.v_dim:
            raise ValueError(f"InplaceKVCache stores K and V in one block and needs equal widths, got {self.layout}")

    @property
    def parts(self) -> int:
        """1 for a shared latent (MLA), 2 for separate K and V."""
        return 1 if self.layout.shared_kv else 2

    @property
    def dim(self) -> int:
        return self.layout.k_dim

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    def block_shape(self) -> tuple[int, int, int, int]:
        """``(parts, kv_heads, D, dim)``: one block of one layer."""
        return (self.parts, self.layout.kv_heads, self.window, self.dim)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one layer."""
        return self.parts * self.layout.kv_heads * self.dim * self.element_size

    @property
    def block_bytes(self) -> int:
        return self.window * self.token_bytes

    @property
    def pingpong_blocks(self) -> int:
        """Blocks per ping-pong buffer (>= 1)."""
        return max(1, self.pingpong_bytes // self.block_bytes)

    # -------------------------------------------------------------- region sizing (bytes)
    def window_bytes(self, batch: int) -> int:
        """GPU bytes of the D-windows of ``batch`` sequences, all layers."""
        return batch * self.num_layers * self.block_bytes

    def pingpong_total_bytes(self) -> int:
        """GPU bytes of all ping-pong buffers (shared by all layers and sequences); none when the
        load region is read in place."""
        if self.load_read == "in-place":
            return 0
        return self.pingpong_buffers * self.pingpong_blocks * self.block_bytes

    def spill_tokens(self, capacity: int) -> int:
        """Tokens of a ``capacity``-token sequence that can leave the D-window (whole blocks)."""
        return (capacity // self.window) * self.window

    def host_bytes(self, capacities: list[int]) -> int:
        """Host bytes if every whole block of every sequence spills (all layers)."""
        return sum(self.spill_tokens(c) for c in capacities) * self.num_layers * self.token_bytes

    def staging_bytes(self, batch: int) -> int:
        """Pinned bytes of the eviction staging buffers (one block per layer per sequence)."""
        return self.window_bytes(batch)
