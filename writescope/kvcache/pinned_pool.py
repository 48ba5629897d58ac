"""Page-locked host buffers kept registered after use and lent again, whole or in part (issue 18).

Registering host memory with CUDA is the slow part of placing a batch's load region. On the H200
machine, ``cudaHostRegister`` of fresh pages ran at 1.6-2.6 GB/s: DeepSeek-V2-Lite 16 x 32K under
``gpu`` pinned 16.3 GB in 8.3-10.0 s (run 24, ``benchmarks/results/gpu_decode_h200.md``).
Unregistering ran at about 55 GB/s. A server admits and frees requests between decode steps, on
the thread that issues them, so every admission stalled the running requests for about half a
second per GB it pinned. A benchmark paid the same before each of its rows.

Each registration is one anonymous mapping (:class:`Mapping`), registered and unregistered as a
whole. The pool lends pieces of mappings (:class:`HostBuffer`: whole pages, contiguous, one
tensor each) and keeps the pieces that :func:`writescope.kvcache.pinned.unpin` gives back,
registered and mapped. Lending rule: a request (rounded up to whole pages) gets the first pages
of the smallest idle piece that holds it, a piece of a mapping already partly lent first among
pieces of one size; the rest of that piece stays idle, a piece of its own, for a later request.
A wholly idle mapping is split only for a request of at least ``MIN_SPLIT`` (a quarter) of it:
a small piece would keep the whole mapping registered while it is lent, where nothing can give
it back to the host (a one-page request once held 32 MiB so). Only when no idle piece may serve
is a new mapping of exactly the request's pages registered. A piece given back merges with the idle pieces beside it in its mapping, so a
mapping all of whose pieces are back is one idle piece again. So a stream of requests registers
only what no idle piece can hold: rows of a benchmark that need smaller load regions than an
earlier row register nothing; rows that need larger ones register their regions anew (a tensor
never spans two mappings).

Bounds:
- Idle pieces hold at most ``idle_cap`` bytes (``WRITESCOPE_PINNED_POOL``: a size such as
  ``8GiB``, ``0`` for no pool; default a quarter of the host's memory). Beyond it, the mappings
  wholly idle longest are unregistered and unmapped first. Idle pieces of a mapping with a piece
  still lent cannot be unregistered: they count towards the cap, but only wholly idle mappings
  go, so idle bytes pass the cap only by such pieces, until their mappings come back whole.
  With the cap at 0 nothing is lent again, not even pieces kept before.
- The bytes of wholly idle mappings (:attr:`PinnedPool.releasable_bytes`) count as available host
  memory (:func:`writescope.budget.memory.available_memory`). A request that finds no idle piece
  of its size first releases wholly idle mappings while the host has less free memory than it
  needs, and all of them if the mapping or the registration fails (then tries once more).
  Pageable KV makes room the same way (:meth:`PinnedPool.make_room`): a batch once it passes its
  capacity check, for its spilled KV, and a sequence before it commits its prompt's compute rows.
- Page-locked memory can therefore reach what is lent (within the pinned budget) plus the idle
  cap plus the idle pieces of mappings partly lent (or lost, below).
- A piece is reused only after an explicit give-back, whose caller promises that no view of it is
  used again and no copy still reads it. A tensor garbage-collected without one loses its piece:
  nothing of that mapping is lent again, and it is unregistered once no piece of it is lent.
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
HEADROOM = 1 / 0.9  # a new mapping needs this many times its size free (check_capacity's 0.9)
MIN_SPLIT = 1 / 4  # a wholly idle mapping lends to requests of at least this share of it (module doc)


@dataclass(eq=False)  # compared by identity
class Mapping:
    """One anonymous mapping registered with CUDA as a whole (whole pages)."""

    mem: mmap.mmap
    ptr: int
    size: int  # bytes mapped and registered
    lent: int = 0  # pieces of it lent now
    lost: bool = False  # a lent piece was garbage-collected: nothing of it is lent again
    registered: bool = True  # False once unregistered (then never lent again)


@dataclass(eq=False)  # compared by identity: the pool's list removes exactly this piece
class HostBuffer:
    """Bytes ``offset .. offset + size - 1`` of ``mapping`` (whole pages): what the pool lends."""

    mapping: Mapping
    offset: int  # bytes from the mapping's start, a multiple of PAGE
    size: int  # bytes, a multiple of PAGE
    lent: bool = False

    @property
    def ptr(self) -> int:
        return self.mapping.ptr + self.offset

    @property
    def mem(self) -> mmap.mmap:
        return self.mapping.mem


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
    """Lends pieces of registered host mappings and keeps the ones given back (see module doc).

    Args:
        register: ``register(ptr, nbytes) -> error code`` (0 on success; CUDA's cudaHostRegister).
        unregister: ``unregister(ptr) -> error code``.
        idle_cap: bytes of idle pieces kept, or a function returning it (read at each take and
            give-back, so an environment variable set later applies).
        free_bytes: the host's free memory in bytes now, or None when unknown (MemAvailable).
        stats: a dict to add ``register_s``, ``register_bytes`` and ``unregister_s``,
            ``unregister_bytes`` (whole mappings), ``reused`` and ``reused_bytes`` (pieces lent
            again, their whole pages) to.
        on_error: called after a failed register or unregister (clears CUDA's sticky error).
    """

    def __init__(self, register: Callable[[int, int], int], unregister: Callable[[int], int],
                 idle_cap: int | Callable[[], int], free_bytes: Callable[[], int | None], stats: dict | None = None,
                 on_error: Callable[[], None] | None = None):
        self._register, self._unregister, self._free = register, unregister, free_bytes
        self._cap_source = idle_cap if callable(idle_cap) else (lambda: idle_cap)
        self._last_cap = 0  # the last cap read that was valid (a bad value set later falls back to it)
        self._on_error = on_error or (lambda: None)
        self._idle: list[HostBuffer] = []  # idle pieces, oldest given back first (merged pieces: at their last give-back)
        self._lock = threading.RLock()  # finalizers drop pieces from whatever thread collects them
        self.stats = stats if stats is not None else {}
        for k in ("register_s", "unregister_s"):
            self.stats.setdefault(k, 0.0)
        for k in ("register_bytes", "unregister_bytes", "reused", "reused_bytes"):
            self.stats.setdefault(k, 0)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the idle pieces that may be lent again (what the cap bounds)."""
        with self._lock:
            return sum(p.size for p in self._idle if not p.mapping.lost)

    @property
    def releasable_bytes(self) -> int:
        """Bytes of the wholly idle mappings: what :meth:`release_idle` gives back to the host now."""
        with self._lock:
            return sum(p.size for p in self._idle if p.mapping.lent == 0 and not p.mapping.lost)

    @property
    def idle_count(self) -> int:
        with self._lock:
            return sum(1 for p in self._idle if not p.mapping.lost)

    def take(self, nbytes: int) -> HostBuffer:
        """A registered piece of ``nbytes`` rounded up to whole pages (one page for 0): the first
        pages of the smallest idle piece that holds it, else a new mapping of exactly that size.

        Raises:
            RuntimeError: the mapping or the registration failed (names the bytes).
        """
        span = whole_pages(max(1, nbytes))
        if self._cap() == 0:  # no pool (now): nothing idle is lent, whatever an earlier cap kept
            self.release_idle()
        else:
            with self._lock:
                piece = self._lend(span)
                if piece is not None:
                    return piece
        self.make_room(span)
        try:
            return self._new(span)
        except (_RegisterError, _MapError):
            self.release_idle()  # once more, with every wholly idle mapping given back to the host
            try:
                return self._new(span)
            except _RegisterError as e:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.3f} GiB failed (CUDA error {e.code}): "
                                   "lower the pinned budget or the batch") from None
            except _MapError as e:
                raise RuntimeError(f"cannot map {nbytes / 2**30:.3f} GiB of host memory for pinned KV: {e.__cause__}") from None

    def give(self, buf: HostBuffer) -> None:
        """Keep ``buf`` for a later :meth:`take` (its lender uses no view of it again), merged
        with the idle pieces beside it, then unregister the mappings wholly idle longest while
        the idle bytes pass the cap. Never raises for the cap: a bad value read now counts as the
        last good one.

        Raises:
            ValueError: ``buf`` is not lent now (given back twice).
        """
        cap = self._cap()
        with self._lock:
            if not buf.lent:
                raise ValueError(f"pinned piece at {buf.ptr:#x} ({buf.size} bytes) given back but not lent")
            buf.lent = False
            m = buf.mapping
            if not m.lost:
                self._idle.append(self._merged(buf))
            self._settle(m)
            if m.lent == 0 and m.size > cap and not m.lost:  # larger than the cap alone: unregistered at once
                self._idle = [p for p in self._idle if p.mapping is not m]
                self._unmap(m)
            while self.idle_bytes > cap and self._release_oldest():
                pass

    def drop(self, buf: HostBuffer) -> None:
        """``buf``'s tensor was garbage-collected without a give-back (a finalizer, any thread):
        nothing of its mapping is lent again; the mapping is unregistered once no piece of it is
        lent (now, if none is). A piece not lent (given back already) is left alone."""
        with self._lock:
            if not buf.lent:
                return
            buf.lent = False
            buf.mapping.lost = True
            self._settle(buf.mapping)

    def release_idle(self) -> int:
        """Unregister every wholly idle mapping; returns the bytes released."""
        with self._lock:
            self._prune()
            whole = [p for p in self._idle if p.mapping.lent == 0]
            self._idle = [p for p in self._idle if p.mapping.lent > 0]
            for p in whole:
                self._unmap(p.mapping)
            return sum(p.size for p in whole)

    def make_room(self, nbytes: int) -> None:
        """Unregister wholly idle mappings, idle longest first, while the host has less free
        memory than an allocation of ``nbytes`` needs (a new mapping here, or pageable KV
        elsewhere). Pieces of mappings partly lent cannot go."""
        with self._lock:
            while any(p.mapping.lent == 0 and not p.mapping.lost for p in self._idle):
                free = self._free()
                if free is None or free >= HEADROOM * nbytes or not self._release_oldest():
                    return

    def _cap(self) -> int:
        """The idle cap now; a source that fails (a bad environment value set after start) gives
        the last good one, so a give-back in a clean-up path never raises for it."""
        try:
            self._last_cap = int(self._cap_source())
        except (ValueError, TypeError):
            pass
        return self._last_cap

    def _lend(self, span: int) -> HostBuffer | None:
        """The first ``span`` bytes of the best idle piece (module doc), or None (lock held)."""
        while True:
            self._prune()
            # a wholly idle mapping is split only for a request of at least MIN_SPLIT of it: a small
            # piece lent from it would keep all of it registered (nothing can release it meanwhile)
            best = min((p for p in self._idle if p.size >= span and (p.mapping.lent > 0 or span >= MIN_SPLIT * p.size)),
                       key=lambda p: (p.size, p.mapping.lent == 0), default=None)
            if best is None:
                return None
            m = best.mapping
            m.lent += 1
            if not m.lost:  # a finalizer run by a collection just now may have lost it: then look again
                break
            self._settle(m)
        i = self._idle.index(best)
        if best.size > span:
            self._idle[i] = HostBuffer(m, best.offset + span, best.size - span)
        else:
            del self._idle[i]
        self.stats["reused"] += 1
        self.stats["reused_bytes"] += span
        return HostBuffer(m, best.offset, span, lent=True)

    def _merged(self, buf: HostBuffer) -> HostBuffer:
        """``buf`` joined with the idle pieces of its mapping that touch it, which leave the idle
        list (lock held)."""
        lo, hi = buf.offset, buf.offset + buf.size
        for p in [p for p in self._idle if p.mapping is buf.mapping and (p.offset + p.size == lo or p.offset == hi)]:
            self._idle.remove(p)
            lo, hi = min(lo, p.offset), max(hi, p.offset + p.size)
        return HostBuffer(buf.mapping, lo, hi - lo)

    def _settle(self, m: Mapping) -> None:
        """One lent piece of ``m`` is lent no more; unregister a lost ``m`` with none lent (lock held)."""
        m.lent -= 1
        if m.lost and m.lent == 0:
            self._unmap(m)

    def _prune(self) -> None:
        """Drop idle pieces of lost mappings from the idle list (lock held)."""
        self._idle = [p for p in self._idle if not p.mapping.lost]

    def _release_oldest(self) -> bool:
        """Unregister the mapping wholly idle longest; False when none is (lock held)."""
        self._prune()
        p = next((p for p in self._idle if p.mapping.lent == 0), None)
        if p is None:
            return False
        self._idle.remove(p)
        self._unmap(p.mapping)
        return True

    def _unmap(self, m: Mapping) -> None:
        """Unregister ``m`` (once; lock held); its pages go back to the host when nothing maps them."""
        if not m.registered:
            return
        m.registered = False
        t0 = time.perf_counter()
        err = int(self._unregister(m.ptr))
        self.stats["unregister_s"] += time.perf_counter() - t0
        if err == 0:
            self.stats["unregister_bytes"] += m.size
        else:
            self._on_error()

    def _new(self, span: int) -> HostBuffer:
        """A new mapping of ``span`` bytes, registered, lent whole."""
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
        return HostBuffer(Mapping(mem, ptr, span, lent=1), 0, span, lent=True)


class _MapError(Exception):
    pass


class _RegisterError(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code
