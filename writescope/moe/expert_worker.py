"""The native host-expert worker: a persistent C++ thread (expert_worker.h, over the generic
native/flag_worker.h) that computes one MoE layer's host-resident experts per job, in order, with
the host-expert kernel (cpu_experts.cpp, as :func:`writescope.moe.cpu_experts.host_experts_forward`),
and never takes the GIL.

One job's inputs, in host memory (on CUDA: pinned, copied there on the current stream before
:meth:`ExpertWorker.submit` sets the ready flag behind the copies; :meth:`ExpertWorker.buffers`
gives such buffers):
- ``x [T, D]`` bf16 or fp32: the layer's tokens;
- ``slot [T, K]`` int32: for token t's k-th routed expert, the host pack slot (first index of
  ``w13`` / ``w2``) the CPU computes, or -1 where it does not (a device expert, or a host expert
  the GPU reads);
- ``rw [T, K]`` float32: the routing weights.
The worker groups the assignments with a slot by slot (ascending slots, tokens ascending within
one), gathers those rows of x, reads each hit expert's weights once, and writes ``y [T, D]``
float32: ``y[t] = sum of rw[t, k] * expert_slot[t, k](x[t])`` over t's assignments with a slot,
each term as host_experts_forward gives it (gate/up in fp32, h rounded to x's dtype, down in
fp32, times the routing weight, rounded to x's dtype), summed in fp32 in ascending slot order;
exactly 0 for a token with no CPU assignment. The hand-offs, errors and sequence numbers are
writescope.native.flag_worker's (shared with the CPU attention worker): a job that fails (a slot
outside ``[-1, E_host)`` written by the device, a failed allocation) writes NaN into y, sets its
done flag, and its error is raised by the next ``check`` / ``consume`` / ``submit`` / ``close``.
"""

from __future__ import annotations

import time

import torch

from writescope.kvcache.pinned import device_view
from writescope.moe import cpu_experts
from writescope.native.flag_worker import FLAG_DONE, FLAG_READY, FlagWorker


def _check(x, slot, rw, w13, w2, y, cuda: bool) -> None:
    """The argument errors, as ValueError naming the bad value (see ExpertWorker.submit)."""
    for name, t in (("x", x), ("slot", slot), ("rw", rw), ("w13", w13), ("w2", w2), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be in host memory (copy it into the worker's pinned buffers), got {t.device}")
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [T, D] bf16 or fp32 tensor, got {list(x.shape)} {x.dtype}"
                         f"{'' if x.is_contiguous() else ' (not contiguous)'}")
    T, D = x.shape
    if slot.dim() != 2 or slot.shape[0] != T or slot.dtype != torch.int32 or not slot.is_contiguous():
        raise ValueError(f"slot must be a contiguous int32 [{T}, K] tensor (one row per token of x), got {list(slot.shape)} {slot.dtype}")
    if rw.shape != slot.shape or rw.dtype != torch.float32 or not rw.is_contiguous():
        raise ValueError(f"rw must be a contiguous float32 {list(slot.shape)} tensor (slot's shape), got {list(rw.shape)} {rw.dtype}")
    if y.shape != (T, D) or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"y must be a contiguous float32 [{T}, {D}] tensor, got {list(y.shape)} {y.dtype}")
    if cuda and not y.is_pinned():
        raise ValueError("y must be pinned on CUDA (a copy of pageable y to the device would not wait for the job): use buffers()")
    E = cpu_experts.check_weights(x, w13, w2)
    if not cuda and slot.numel():  # on CUDA the device writes slot after submit: the worker checks it
        lo, hi = int(slot.min()), int(slot.max())
        if lo < -1 or hi >= E:
            bad = slot[(slot < -1) | (slot >= E)].unique().tolist()
            raise ValueError(f"slots {bad[:5]} outside [-1, {E}) (w13 holds {E} experts; -1: not computed on the CPU)")


BUFFER_SETS = 8  # buffers() keeps this many shapes' sets (a server's batch sizes, two micro-batches)


class ExpertWorker(FlagWorker):
    """One worker thread (its own, or a team's) whose jobs, the host experts of MoE layers, run on
    ``threads`` OpenMP threads (that thread included). ``consume``, ``wait_host``, ``done_value``, ``check``,
    ``trace``, ``take_trace``, ``threads``, ``pinned`` and ``close`` are
    :class:`writescope.native.flag_worker.FlagWorker`'s; ``totals()`` gives (jobs done, seconds
    computing, weight bytes read, experts computed).

    Args:
        threads: CPU threads of the experts (>= 1).
        device: the device whose stream hands the inputs over and consumes y (CPU: the host does).
        cpus: the CPUs the worker thread and its team may run on (None: wherever the process may;
            with ``team``, the team's stand).
        team: a :class:`writescope.native.team.CpuTeam` to run the jobs on (None: a thread of its own).

    Raises:
        ValueError: ``threads`` < 1; RuntimeError: the host-expert kernel cannot be built;
            ImportError: on CUDA, Triton is missing.
    """

    def __init__(self, threads: int, device: torch.device | str, cpus: list[int] | None = None, team=None):
        threads = int(threads)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        ext = cpu_experts._extension()
        if ext is None:
            raise RuntimeError("the host-expert kernel could not be built: no native expert worker")
        self.cpus = [int(c) for c in cpus] if cpus else []
        self._buffers: dict[tuple, tuple] = {}  # (T, K, D, dtype) -> (x, slot, rw, y) of buffers(), the newest last
        self._views: dict[tuple, torch.Tensor] = {}  # the same key -> y's device view (output_view)
        # (event, set) of sets buffers() let go on CUDA, kept until the stream has passed the work issued before:
        # a kernel reading y in place may still be queued, and torch's pinned allocator knows only of copies
        self._retired: list[tuple] = []
        super().__init__(ext, lambda ex, post: ext.ExpertWorker(threads, self.cpus, 0, ex, post), torch.device(device), "host-expert worker",
                         team=team)

    def buffers(self, T: int, K: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host buffers for one layer's job: ``x [T, D]`` of ``dtype``, ``slot [T, K]`` int32,
        ``rw [T, K]`` float32 and ``y [T, D]`` float32, pinned when the device is CUDA (plain CPU
        tensors otherwise). The same tensors again for the same shape (one set per shape and
        worker: the jobs of one stream are consumed in order, so a job's buffers are free once the
        stream has waited for its done flag; on the host, once :meth:`consume` returned); the last
        ``BUFFER_SETS`` shapes are kept (an older set stays alive while a job in flight uses it, and
        on CUDA until the stream has passed the work issued before it was let go: an add reading y
        in place, :meth:`output_view`).

        Raises:
            ValueError: a negative size, or ``dtype`` neither bf16 nor fp32.
        """
        T, K, D = int(T), int(K), int(D)
        if min(T, K, D) < 0:
            raise ValueError(f"sizes must be >= 0, got T={T}, K={K}, D={D}")
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float32 (x's), got {dtype}")
        key = (T, K, D, dtype)
        bufs = self._buffers.pop(key, None)
        if bufs is None:
            pin = self.cuda
            bufs = (torch.empty(T, D, dtype=dtype, pin_memory=pin), torch.full((T, K), -1, dtype=torch.int32, pin_memory=pin),
                    torch.zeros(T, K, dtype=torch.float32, pin_memory=pin), torch.zeros(T, D, dtype=torch.float32, pin_memory=pin))
            self._retired = [(ev, old) for ev, old in self._retired if not ev.query()]
            while len(self._buffers) >= BUFFER_SETS:
                lru = next(iter(self._buffers))  # the least recently used shape
                old = self._buffers.pop(lru)
                self._views.pop(lru, None)
                if self.cuda:
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self.device))
                    self._retired.append((ev, old))
        self._buffers[key] = bufs  # the newest last
        return bufs

    def _held(self, bufs: tuple) -> tuple:
        """The key of ``bufs`` in :meth:`buffers`' sets (raises ValueError unless the worker holds it)."""
        x, slot = bufs[0], bufs[1]
        key = (x.shape[0], slot.shape[1], x.shape[1], x.dtype)
        if self._buffers.get(key) is not bufs:
            raise ValueError("bufs must be a set this worker's buffers() gave (and still holds)")
        return key

    def output_view(self, bufs: tuple, device: torch.device) -> torch.Tensor:
        """y of a set :meth:`buffers` holds, as a tensor on ``device`` over its pinned bytes (read by
        kernels in place, over PCIe: :func:`writescope.kvcache.pinned.device_view`), made once per
        set; without CUDA y itself.

        Raises:
            ValueError: ``bufs`` is not a set this worker holds.
        """
        key, y = self._held(bufs), bufs[3]
        if not self.cuda:
            return y
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = device_view(y, torch.device(device))
        return view

    def submit_buffers(self, bufs: tuple, w13: torch.Tensor, w2: torch.Tensor) -> int:
        """:meth:`submit` of a set from :meth:`buffers` (x, slot and rw written by the caller, on
        the current stream with CUDA), without its Python checks: the buffers were made right, and
        the native call checks the weights against them (the decode step's path, one call a MoE
        layer on the thread that issues the step).

        Raises:
            ValueError: ``bufs`` is not a set :meth:`buffers` holds; RuntimeError: the weights do
                not match (the native check's message), an earlier job failed, or the worker is closed.
        """
        self._held(bufs)
        return self._submit_set(bufs, w13, w2, ready=True)

    def post_buffers(self, bufs: tuple, w13: torch.Tensor, w2: torch.Tensor) -> int:
        """:meth:`submit_buffers` of a job whose inputs are written later, its ready flag left to
        :meth:`mark_ready` (a CUDA graph's copies and flag kernel, replayed after this call: the
        job waits for them); ``bufs`` may be a set :meth:`buffers` no longer holds (the graph's
        hook holds it). Returns the job's value.

        Raises:
            RuntimeError: the weights do not match, an earlier job failed, or the worker is closed.
        """
        return self._submit_set(bufs, w13, w2, ready=False)

    def _submit_set(self, bufs: tuple, w13: torch.Tensor, w2: torch.Tensor, ready: bool) -> int:
        entered = time.perf_counter_ns()
        try:
            x, slot, rw, y = bufs
            isa = cpu_experts.requested_path()
            return self._issue((bufs, w13, w2), lambda v: self._w.submit(
                x, slot, rw, w13, w2, y, isa, self.flags, FLAG_READY, v, FLAG_DONE, v), ready=ready)
        finally:
            self.submit_total_ns += time.perf_counter_ns() - entered

    def submit(self, x: torch.Tensor, slot: torch.Tensor, rw: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, y: torch.Tensor) -> int:
        """Queue one layer's host experts (see the module's docstring for the inputs and y); the
        weights ``w13 [E_host, 2I, D]``, ``w2 [E_host, D, I]`` (x's dtype, unit last stride) are the
        block's host pack, read in place. On CUDA the ready flag is set on the current stream after
        whatever was issued before (the copies into x, slot and rw); without CUDA the host sets it
        now. Returns the job's sequence number. The tensors are kept alive until it is done; the
        caller must not write x, slot, rw or y until then.

        Raises:
            ValueError: bad arguments (names the value; without CUDA also a slot outside
                ``[-1, E_host)``); RuntimeError: an earlier job failed, the worker is closed, or
                ``WRITESCOPE_EXPERT_ISA`` forces a path this CPU lacks.
        """
        entered = time.perf_counter_ns()
        try:
            _check(x, slot, rw, w13, w2, y, self.cuda)
            isa = cpu_experts.requested_path()
            return self._issue((x, slot, rw, w13, w2, y), lambda v: self._w.submit(
                x, slot, rw, w13, w2, y, isa, self.flags, FLAG_READY, v, FLAG_DONE, v))
        finally:
            self.submit_total_ns += time.perf_counter_ns() - entered

    def take_done(self) -> list[tuple[float, int, int]]:
        """``(seconds, weight bytes read, experts computed)`` of each job finished since the last
        call, in order (seconds: from seeing its inputs to its done flag; bytes: the distinct slots
        times one expert's w13 + w2 bytes). The last 4096 are kept."""
        return [(secs, nbytes, experts) for _, secs, nbytes, experts in self._take_done()]

    def _closed(self) -> None:
        self._buffers, self._views = {}, {}
