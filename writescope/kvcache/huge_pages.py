"""The compute region in transparent huge pages (``WRITESCOPE_HUGE_PAGES``).

The CPU half reads each sequence's compute region, tens of megabytes per layer, once per step.
With 4 KiB pages every 4 KiB of it needs its own TLB entry; asking the kernel for 2 MiB pages
(``madvise(MADV_HUGEPAGE)`` on an anonymous mapping, used where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``) cuts the page walks
of that read 512-fold. Whether it pays is measured (benchmarks/results/gpu_decode_h200.md, run 31:
not in whole steps, so it is off by default).

Memory: each (layer, part, kv head) stretch of a compute region fills from its start, and the
kernel may commit a whole 2 MiB page for a stretch's first bytes, so a sequence can hold up to
2 MiB x layers x parts x kv_heads more than its tokens need (54 MiB for DeepSeek-V2-Lite's 27
latent stretches, 0.84 GiB at batch 16), which the host-memory check does not count.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

from writescope.env import env_choice

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_wanted() -> bool:
    """``WRITESCOPE_HUGE_PAGES``: ``on`` allocates compute regions as anonymous mappings advised
    for huge pages; ``off`` (the default) through torch's allocator.

    Raises:
        ValueError: another value (names it).
    """
    return env_choice("WRITESCOPE_HUGE_PAGES", ("off", "on")) == "on"


def thp_mode() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or
    ``unknown`` where it cannot be read."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return "unknown"
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), "unknown")


def compute_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor of ``shape`` for a compute region: with
    ``WRITESCOPE_HUGE_PAGES=on`` (and ``madvise`` available) an anonymous mapping advised for
    huge pages, else ``torch.empty``. Pages are committed when first written either way.

    Raises:
        RuntimeError: the mapping failed (names the bytes).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not huge_pages_wanted() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise RuntimeError(f"cannot map {nbytes / 2**30:.3f} GiB of host memory for a compute region {tuple(shape)} {dtype}: {e}") from e
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: torch's allocator, as with the switch off
        m.close()
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(m, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)  # keeps the mapping alive
