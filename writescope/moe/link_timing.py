"""G measured inside decode steps: how long the fused decode kernels take to read the link's share of
a layer's host experts in place over PCIe while everything else of the step runs (issue 16).

Why: G at attach (scheduler/expert_work.measure_link_expert_cost) is timed with the host idle. In a
step the expert worker reads host memory at 80-100 GB/s and the copy stream carries the next
layer's KV at the same time. On the H200 (run 58, benchmarks/results/gpu_decode_h200.md) Qwen3-30B-A3B
16 x 16K streamed 364 of 2,013 hit host experts a step with G 43 GB/s from attach and took 510 ms,
where ``static:0.5`` with the CPU computing all of them took 422 (attention within 3% of it):
each layer's expert phase took about 2.6 ms longer than the model expected, as if the streamed
experts were read at about 26 GB/s and not beside the CPU's. A likely cause, not yet measured:
the in-place read is many small PCIe reads from the SMs, each waiting on host memory's latency,
which grows while the CPU reads at 80-100 GB/s.

:class:`LinkTimer` times one layer step at a time, at most one in flight, every ``every``-th
layer step that streams: the number of host experts the link reads is counted on the device and
copied to pinned memory, then CUDA events bracket the fused kernels. A later layer's call
collects it once the end event has passed (``query``, no wait; never while a CUDA graph is
captured, where querying an event is not allowed). The first timing (the kernels' first call at a
shape may compile) and timings of fewer than :data:`MIN_EXPERTS` experts that read under
:data:`MIN_BYTES` are not used.

A timing is also not used when its start event had already passed once the issuing thread had
issued the kernels (one ``query`` then, no wait): the device then ran the window while the thread
was still issuing it, and the time would count the thread's issue time as the read's (run 58: at
Qwen3 batch 4 the step is issue-bound). When the device runs behind the thread, as in steps the
link or the GPU bound, the start has not passed and the window is the device's own time.
:attr:`LinkTimer.issue_bound` counts the timings left out this way.
"""

from __future__ import annotations

import torch

# Every how many layer steps that stream host experts one is timed, when none is in flight (each
# costs about six launches and two events on the issuing thread). A timing stays in flight until a
# later layer finds its end passed, and the issuing thread runs ahead of the device, so a step
# gets a few: fewer than its layers / SAMPLE_EVERY.
SAMPLE_EVERY = 4
# Timings of fewer experts are not used: a one-expert read is a few hundred microseconds, where the
# dozen small launches inside the window are a visible share (G is per byte, with no fixed part).
MIN_EXPERTS = 2
# ... unless they read this many bytes: about 0.7 ms at 50 GB/s, where the launches (tens of
# microseconds) weigh a few percent. One Mixtral-8x7B expert is 352 MB: its layer steps stream about
# one each at batch 4, so with the count alone run 59 kept 0-2 timings a grid row (Qwen3's, 9.4 MB
# an expert, still need two).
MIN_BYTES = 32 << 20


def link_expert_count(ids: torch.Tensor, link_slot_of: torch.Tensor, hosted: int) -> torch.Tensor:
    """0-dim int64 tensor on ids' device: the host experts the link reads for routing ``ids``
    (``[T, K]`` int64), i.e. hit experts whose ``link_slot_of`` (``[E]`` int64, from
    :func:`writescope.moe.async_experts.partition`) is a host pack slot (< ``hosted``). No host wait."""
    hit = torch.zeros(link_slot_of.shape[0], dtype=torch.bool, device=ids.device)
    hit.index_fill_(0, ids.flatten(), True)
    return (hit & (link_slot_of < hosted)).sum()


class LinkTimer:
    """In-step timings of the link's host experts (module docstring).

    Args:
        every: time one of this many layer steps that stream (>= 1).
        min_experts: timings of fewer host experts are not used (:data:`MIN_EXPERTS`) unless they
            read at least ``min_bytes`` (:data:`MIN_BYTES`).
        event: makes a timing event with ``record()``, ``query()`` and ``elapsed_time(end)`` in ms
            (default: ``torch.cuda.Event(enable_timing=True)``; tests pass stand-ins).

    Raises:
        ValueError: ``every`` < 1.
    """

    def __init__(self, every: int = SAMPLE_EVERY, event=None, min_experts: int = MIN_EXPERTS, min_bytes: int = MIN_BYTES):
        if not every >= 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self.min_experts, self.min_bytes = every, min_experts, min_bytes
        self._first = True  # the first timing is not used (a first call may compile)
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._seen = 0
        self._pending = None  # (start, end, bytes per expert, issue-bound) of the timing in flight
        self._count = None  # pinned int64 scalar the count is copied into
        self.issue_bound = 0  # timings not used: the device waited for the issuing thread (module docstring)

    def wants(self, force: bool = False) -> bool:
        """Whether to time this layer step: none in flight, and the ``every``-th that asks, or
        ``force`` (a probe of the link: scheduler/expert_work.PROBE_EVERY)."""
        if self._pending is not None:
            return False
        self._seen += 1
        return force or self._seen % self.every == 0

    def start(self, count: torch.Tensor):
        """Before the kernels: ``count`` (0-dim int64 on the device, :func:`link_expert_count`)
        copied to pinned memory, then the start event; returns it for :meth:`finish`."""
        if self._count is None:
            self._count = torch.zeros((), dtype=torch.int64, pin_memory=count.is_cuda)
        self._count.copy_(count, non_blocking=count.is_cuda)
        start = self._event()
        start.record()
        return start

    def finish(self, start, expert_nbytes: int) -> None:
        """After the kernels were issued: whether the start has passed already (the device waited
        for this thread: module docstring), then the end event; collected by :meth:`collect`."""
        waited = bool(start.query())
        end = self._event()
        end.record()
        self._pending = (start, end, expert_nbytes, waited)

    def collect(self) -> tuple[float, int] | None:
        """``(seconds, weight bytes read)`` of the timing in flight once its end event has passed
        (no wait), else None; None too for the first timing, one that read no expert or fewer
        than ``min_experts`` under ``min_bytes``, and one whose window the device ran while this thread issued it
        (counted in :attr:`issue_bound`; module docstring). Not while a CUDA graph is captured
        (the caller checks: querying an event is not allowed then)."""
        if self._pending is None:
            return None
        start, end, nbytes, waited = self._pending
        if not end.query():
            return None
        self._pending = None
        n = int(self._count)
        first, self._first = self._first, False
        if first or n < 1 or (n < self.min_experts and n * nbytes < self.min_bytes):
            return None
        if waited:
            self.issue_bound += 1
            return None
        return start.elapsed_time(end) * 1e-3, n * nbytes

    def drop(self) -> None:
        """Forget the timing in flight (after a failed step; its events are not waited for)."""
        self._pending = None
