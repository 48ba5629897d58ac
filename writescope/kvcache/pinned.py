"""Exactly sized pinned host memory through ``cudaHostRegister``.

PyTorch's pinned caching allocator rounds each request up to a power of two (on the H200
machine ``torch.empty(9 GiB, pin_memory=True)`` took 7.8 s and reserved 16 GiB), while
registering an exactly sized host tensor took 0.6 s and streams at the same 55 GB/s
(../shared/HARDWARE.md). Without CUDA the tensor is returned unpinned.
"""

from __future__ import annotations

import torch


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor of ``shape``; page-locked by ``cudaHostRegister`` when ``pin``.

    Raises:
        RuntimeError: the allocation or the registration failed (message names the bytes).
    """
    try:
        t = torch.empty(shape, dtype=dtype)
    except RuntimeError as e:  # CPU allocation failures raise RuntimeError
        raise RuntimeError(f"cannot allocate {_gib(shape, dtype)} of host memory for KV: {e}") from e
    if pin and t.numel() > 0:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise RuntimeError(
                f"cudaHostRegister of {_gib(shape, dtype)} failed (error {int(err)}): lower the pinned budget or the batch"
            )
    return t


def unpin(t: torch.Tensor) -> None:
    """Undo :func:`host_empty`'s registration (call once, before dropping the tensor)."""
    if t.numel() > 0 and torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _gib(shape, dtype) -> str:
    n = 1
    for s in shape:
        n *= s
    return f"{n * torch.tensor([], dtype=dtype).element_size() / 2**30:.3f} GiB"
