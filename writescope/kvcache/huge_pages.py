"""The compute region in transparent huge pages (``WRITESCOPE_HUGE_PAGES``).

The CPU half reads each sequence's compute region, tens of megabytes per layer, once per step.
With 4 KiB pages every 4 KiB of it needs its own TLB entry; asking the kernel for 2 MiB pages
(``madvise(MADV_HUGEPAGE)`` on an anonymous mapping, used where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``) cuts the page walks
of that read 512-fold. Whether it pays is measured (benchmarks/results/gpu_decode_h200.md).
"""

from __future__ import annotations

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
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if nbytes == 0 or not huge_pages_wanted() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise RuntimeError(f"cannot map {nbytes / 2**30:.3f} GiB of host memory for a compute region {tuple(shape)} {dtype}: {e}") from e
    m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)  # keeps the mapping alive
