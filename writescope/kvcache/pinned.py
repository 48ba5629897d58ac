"""Exactly sized pinned host memory through ``cudaHostRegister``, from a pool of registered buffers.

PyTorch's pinned caching allocator rounds each request up to a power of two (on the H200
machine ``torch.empty(9 GiB, pin_memory=True)`` took 7.8 s and reserved 16 GiB), while
registering an exactly sized host tensor took 0.6 s and streams at the same 55 GB/s
(docs/HARDWARE.md). Registration works on whole pages, so each registered tensor is an
anonymous mapping, or a page-aligned piece of one, shared with no other tensor while lent (the
size is rounded up to whole pages only). :func:`unpin` gives the piece back to :data:`POOL`
(kvcache/pinned_pool.py), which keeps it registered and lends it, or its first pages, to a later
tensor of its size or smaller (``WRITESCOPE_PINNED_POOL=0``: unregistered once no piece of its
mapping is lent). A tensor
garbage-collected without :func:`unpin` is never reused; its mapping is unregistered once no
piece of it is lent. Without CUDA the tensor is returned unpinned.
"""

from __future__ import annotations

import weakref

import torch

from writescope.host_memory import host_free_now, host_memory_total
from writescope.kvcache.pinned_pool import PAGE, PinnedPool, idle_cap_from_env  # noqa: F401 - PAGE imported from here too

# seconds and bytes of every registration and unregistration in this process (wall time of the
# CUDA calls), and the pieces the pool lent again instead: what a request's admission and its
# freeing cost the thread that issues the GPU work (the bench keeps each row's share:
# writescope/bench/runner.py)
STATS = {"register_s": 0.0, "register_bytes": 0, "unregister_s": 0.0, "unregister_bytes": 0, "reused": 0, "reused_bytes": 0}


def _register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def _pool_cap() -> int:
    return idle_cap_from_env(host_memory_total())


POOL = PinnedPool(_register, _unregister, _pool_cap, host_free_now, STATS, on_error=lambda: _clear_cuda_error())


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor of ``shape``; page-locked by ``cudaHostRegister`` when ``pin`` (a buffer of
    :data:`POOL`: an idle piece of its size or the first pages of a larger one, lent again, or a
    new registration).

    Raises:
        RuntimeError: the allocation or the registration failed (message names the bytes).
    """
    itemsize = dtype.itemsize
    nbytes = itemsize
    for s in shape:
        nbytes *= s
    if not pin or nbytes == 0:
        try:
            return torch.empty(shape, dtype=dtype)
        except RuntimeError as e:  # CPU allocation failures raise RuntimeError
            raise RuntimeError(f"cannot allocate {nbytes / 2**30:.3f} GiB of host memory for KV {tuple(shape)} {dtype}: {e}") from e
    buf = POOL.take(nbytes)
    t = torch.frombuffer(buf.mem, dtype=dtype, count=nbytes // itemsize, offset=buf.offset).view(shape)  # keeps the mapping alive
    t._writescope_unpin = weakref.finalize(t, POOL.drop, buf)  # type: ignore[attr-defined]
    return t


class _DeviceArray:
    """A CUDA array interface over host bytes (for :func:`device_view`); holds the host tensor."""

    def __init__(self, t: torch.Tensor):
        self.host = t
        self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "version": 3}


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the bytes of the contiguous page-locked host tensor ``t`` (unified
    addressing: a registered host page is read by kernels at its host address, over PCIe), same
    shape and dtype; it keeps ``t`` alive. Without CUDA (``device`` not cuda) ``t`` itself.

    Raises:
        ValueError: ``t`` is not contiguous, not page-locked, or not addressable by ``device`` at its
            host address.
    """
    if device.type != "cuda":
        return t
    if not t.is_contiguous():
        raise ValueError(f"device_view needs a contiguous host tensor, got strides {t.stride()} for {tuple(t.shape)}")
    if not t.is_pinned():
        raise ValueError(f"device_view needs page-locked host memory (host_empty with pin=True), got {tuple(t.shape)} unpinned")
    raw = torch.as_tensor(_DeviceArray(t), device=device)  # [nbytes] uint8
    if raw.data_ptr() != t.data_ptr():  # torch copied (another device asked for): not a view of the host bytes
        raise ValueError(f"device_view: {device} cannot address this host memory at its host address (torch made a copy); "
                         "use the device the memory was registered for")
    return raw.view(t.dtype).view(t.shape)


def unpin(t: torch.Tensor) -> None:
    """Give ``t``'s page-locked bytes back (idempotent; a no-op for unpinned tensors): to
    :data:`POOL`, which may lend them to a later :func:`host_empty` of their size or less, so the
    caller must not use ``t`` or a view of it again, nor leave a copy reading it in flight."""
    fin = getattr(t, "_writescope_unpin", None)
    info = fin.detach() if fin is not None else None
    if info is not None:
        POOL.give(info[2][0])


def _clear_cuda_error() -> None:
    """A failed runtime call leaves its error for the next ``cudaGetLastError`` (torch's launch
    checks): read it once so later kernels do not report it. Best effort."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libcudart" in line}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
    except OSError:
        pass
