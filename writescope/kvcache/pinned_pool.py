"""Page-locked host buffers kept registered after use and lent again (issue 18).

Registering host memory with CUDA is the slow part of placing a batch's load region. On the H200
machine, ``cudaHostRegister`` of fresh pages ran at 1.6-2.6 GB/s: DeepSeek-V2-Lite 16 x 32K under
``gpu`` pinned 16.3 GB in 8.3-10.0 s (run 24, ``benchmarks/results/gpu_decode_h200.md``).
Unregistering ran at about 55 GB/s. A server admits and frees requests between decode steps, on
the thread that issues them, so every admission stalled the running requests for about half a
second per GB it pinned. A benchmark paid the same before each of its rows.

The pool keeps the buffers that :func:`writescope.kvcache.pinned.unpin` gives back, registered
and mapped, and lends one again for a request of its size or a little smaller (at most
``SLACK`` of the request larger; the rest stays unused while lent). So a stream of requests of
similar lengths registers nothing after the first ones.

Bounds:
- Idle buffers hold at most ``idle_cap`` bytes (``WRITESCOPE_PINNED_POOL``: a size such as
  ``8GiB``, ``0`` for no pool; default a quarter of the host's memory). Beyond it, the buffers
  idle longest are unregistered and unmapped first. With the cap at 0, nothing kept before is
  lent either.
- Idle bytes count as available host memory (:func:`writescope.budget.memory.available_memory`).
  A request that finds no idle buffer of its size first releases idle ones while the host has
  less free memory than it needs, and all of them if the mapping or the registration fails (then
  tries once more). Pageable KV makes room the same way (:meth:`PinnedPool.make_room`): a batch
  once it passes its capacity check, for its spilled KV, and a sequence before it commits its
  prompt's compute rows.
- Page-locked memory can therefore reach what is lent (within the pinned budget, plus up to
  ``SLACK`` of each buffer) plus the idle cap.
- A buffer is reused only after an explicit give-back, whose caller promises that no view of it
  is used again and no copy still reads it. A tensor garbage-collected without one is
  unregistered and never reused.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from writescope.units import parse_size

PAGE = mmap.PAGESIZE
SLACK = 1 / 8  # an idle buffer serves requests down to 1 / (1 + SLACK) of its size
HEADROOM = 1 / 0.9  # a new buffer needs this many times its size free (check_capacity's 0.9)


@dataclass(eq=False)  # compared by identity: the pool's list removes exactly this buffer
class HostBuffer:
    """One anonymous mapping registered with CUDA (whole pages)."""

    mem: mmap.mmap
    ptr: int
    size: int  # bytes mapped and registered


def whole_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def idle_cap_from_env(total_host: int | None) -> int:
    """``WRITESCOPE_PINNED_POOL``: the idle bytes the pool may keep (``0``: no pool; unset or
    ``auto``: a quarter of ``total_host``, 0 when that is unknown).

    Raises:
        ValueError: not a size, ``0`` or ``auto`` (names the variable and the value).
    """
    text = os.environ.get("WRITESCOPE_PINNED_POOL", "auto").strip()
    if text.lower() == "auto":
        return (total_host or 0) // 4
    if text == "0":
        return 0
    try:
        return parse_size(text)
    except ValueError:
        raise ValueError(f"WRITESCOPE_PINNED_POOL={text!r}: use a size such as 8GiB or 512MiB, 0 (no pool) or auto (the default: "
                         "a quarter of the host's memory)") from None


class PinnedPool:
    """Lends registered host buffers and keeps the ones given back (see module doc).

    Args:
        register: ``register(ptr, nbytes) -> error code`` (0 on success; CUDA's cudaHostRegister).
        unregister: ``unregister(ptr) -> error code``.
        idle_cap: bytes of idle buffers kept, or a function returning it (read at each give-back,
            so an environment variable set later applies).
        free_bytes: the host's free memory in bytes now, or None when unknown (MemAvailable).
        stats: a dict to add ``register_s``, ``register_bytes``, ``unregister_s``,
            ``unregister_bytes``, ``reused`` and ``reused_bytes`` to.
    """

    def __init__(self, register: Callable[[int, int], int], unregister: Callable[[int], int],
                 idle_cap: int | Callable[[], int], free_bytes: Callable[[], int | None], stats: dict | None = None,
                 on_error: Callable[[], None] | None = None):
        self._register, self._unregister, self._free = register, unregister, free_bytes
        self._cap_source = idle_cap if callable(idle_cap) else (lambda: idle_cap)
        self._last_cap = 0  # the last cap read that was valid (a bad value set later falls back to it)
        self._on_error = on_error or (lambda: None)
        self._idle: list[HostBuffer] = []  # oldest first
        self._lock = threading.RLock()  # finalizers drop buffers from whatever thread collects them
        self.stats = stats if stats is not None else {}
        for k in ("register_s", "unregister_s"):
            self.stats.setdefault(k, 0.0)
        for k in ("register_bytes", "unregister_bytes", "reused", "reused_bytes"):
            self.stats.setdefault(k, 0)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._idle)

    @property
    def idle_count(self) -> int:
        with self._lock:
            return len(self._idle)

    def take(self, nbytes: int) -> HostBuffer:
        """A registered buffer of at least ``nbytes`` (rounded up to whole pages): an idle one of
        that size up to ``1 + SLACK`` times it (the smallest such), else a new mapping.

        Raises:
            RuntimeError: the mapping or the registration failed (names the bytes).
        """
        span = whole_pages(max(1, nbytes))
        if self._cap() == 0:  # no pool (now): nothing idle is lent, whatever an earlier cap kept
            self.release_idle()
        with self._lock:
            fits = [b for b in self._idle if span <= b.size <= span + int(SLACK * span)]
            if fits:
                buf = min(fits, key=lambda b: b.size)
                self._idle.remove(buf)
                self.stats["reused"] += 1
                self.stats["reused_bytes"] += buf.size
                return buf
            self.make_room(span)
        try:
            return self._new(span)
        except (_RegisterError, _MapError):
            self.release_idle()  # once more, with every idle buffer given back to the host
            try:
                return self._new(span)
            except _RegisterError as e:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.3f} GiB failed (CUDA error {e.code}): "
                                   "lower the pinned budget or the batch") from None
            except _MapError as e:
                raise RuntimeError(f"cannot map {nbytes / 2**30:.3f} GiB of host memory for pinned KV: {e.__cause__}") from None

    def give(self, buf: HostBuffer) -> None:
        """Keep ``buf`` for a later :meth:`take` (its lender uses no view of it again), then drop
        the buffers idle longest while the idle bytes pass the cap. Never raises for the cap: a
        bad value read now counts as the last good one."""
        cap = self._cap()
        with self._lock:
            if buf.size > cap:
                self.drop(buf)
            else:
                self._idle.append(buf)
            while self._idle and sum(b.size for b in self._idle) > cap:
                self.drop(self._idle.pop(0))

    def drop(self, buf: HostBuffer) -> None:
        """Unregister ``buf`` now; its pages go back to the host when nothing maps them."""
        t0 = time.perf_counter()
        err = int(self._unregister(buf.ptr))
        with self._lock:
            self.stats["unregister_s"] += time.perf_counter() - t0
            if err == 0:
                self.stats["unregister_bytes"] += buf.size
        if err != 0:
            self._on_error()

    def release_idle(self) -> int:
        """Unregister every idle buffer; returns the bytes released."""
        with self._lock:
            idle, self._idle = self._idle, []
        for b in idle:
            self.drop(b)
        return sum(b.size for b in idle)

    def _cap(self) -> int:
        """The idle cap now; a source that fails (a bad environment value set after start) gives
        the last good one, so a give-back in a clean-up path never raises for it."""
        try:
            self._last_cap = int(self._cap_source())
        except (ValueError, TypeError):
            pass
        return self._last_cap

    def make_room(self, nbytes: int) -> None:
        """Drop idle buffers, longest idle first, while the host has less free memory than an
        allocation of ``nbytes`` needs (a new mapping here, or pageable KV elsewhere)."""
        with self._lock:
            while self._idle:
                free = self._free()
                if free is None or free >= HEADROOM * nbytes:
                    return
                self.drop(self._idle.pop(0))

    def _new(self, span: int) -> HostBuffer:
        try:
            mem = mmap.mmap(-1, span)
        except (OSError, ValueError) as e:
            raise _MapError() from e
        if hasattr(mmap, "MADV_HUGEPAGE"):  # registration faults every page in: 2 MiB pages fault 512x less
            mem.madvise(mmap.MADV_HUGEPAGE)
        import ctypes

        anchor = ctypes.c_char.from_buffer(mem)
        ptr = ctypes.addressof(anchor)
        del anchor  # the export would keep the mapping from ever closing
        t0 = time.perf_counter()
        err = int(self._register(ptr, span))
        with self._lock:
            self.stats["register_s"] += time.perf_counter() - t0
            if err == 0:
                self.stats["register_bytes"] += span
        if err != 0:
            self._on_error()
            mem.close()
            raise _RegisterError(err)
        return HostBuffer(mem, ptr, span)


class _MapError(Exception):
    pass


class _RegisterError(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code
