"""The Python side of a native flag worker (native/flag_worker.h): a persistent C++ thread that runs
one job per layer, in order, and never takes the GIL; the CPU attention worker
(attention/cpu_worker.py, ``NativeWorker``) and the host-expert worker (moe/expert_worker.py,
``ExpertWorker``) are its two kinds (docs/DESIGN.md section 10).

Hand-offs, all through one pinned int32 flag pair per worker (sequence numbers, modulo 2^32):
- ``ready``: the job's inputs are in host memory. On CUDA the stream sets it after their copies (a
  one-CTA Triton kernel storing into the pinned flag through its device address,
  attention/flag_kernels.py); without CUDA the host sets it at submit.
- ``done``: the job's outputs are in their pinned buffers. On CUDA the stream waits for it with a
  one-CTA Triton kernel spinning on the flag (``cuStreamWaitValue32`` hung on the H200 machine:
  docs/HARDWARE.md), so the thread that issues the step does not wait; without CUDA the host
  waits (GIL released).
A job that fails fills its outputs with NaN, still sets its done flag (nothing waits forever), and
its error is raised by the next :meth:`FlagWorker.check` (called by every ``submit``, ``consume``
and ``close``). The GPU wait gives up after ``flag_kernels.MAX_POLLS`` polls (tens of seconds) and
writes a third pinned flag, which ``check`` reads (no device sync) and raises.
Sequence numbers count without bound in Python; the flags hold them modulo 2^32 as int32, and
every comparison is a signed 32-bit difference (valid while fewer than 2^31 jobs are in flight).
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Callable

import torch

WAIT_SECONDS = 60.0  # the longest a stream or the host waits for one job
FLAG_READY, FLAG_DONE, FLAG_TIMEOUT = 0, 1, 2
SLOT_CHUNK = 8192  # job slots of a worker (one per captured stage; 32 KiB pinned, 32 KiB on the device)


class WorkerError(RuntimeError):
    """A job of a native worker failed, or a wait for one gave up: raised to the caller, never
    taken for a failed graph capture (models/graphs.py), since the check that raises it has cleared it."""


def int32(n: int) -> int:
    """n modulo 2^32, as a signed int32 (what the flags hold)."""
    return (n + 2**31) % 2**32 - 2**31


def reached(flag: int, value: int) -> bool:
    """flag has reached value, both int32, modulo 2^32."""
    return (flag - value) % 2**32 < 2**31


class FlagWorker:
    """The flags, the sequence numbers, the tensors of the jobs in flight and the errors of one
    native worker (a ``FlagWorker<J>`` binding of the extension ``ext``, which also binds
    ``wait_flag``); subclasses call its ``submit`` through :meth:`_issue`.

    Args:
        ext: the extension module (its ``wait_flag`` is the host's wait).
        make: makes the native worker, called last with the executor's address and post function
            (the team's, or 0 and 0: the worker makes its own thread).
        device: the device whose stream hands the inputs over and consumes the results (CPU: the
            host does).
        what: the worker in messages (``"CPU attention worker"``).
        flag_kernels: on CUDA, writescope.attention.flag_kernels (None: imported here, before the
                native worker is made, so a missing Triton leaves no thread behind).
        team: a :class:`writescope.native.team.CpuTeam` whose thread runs the jobs, in submit
            order with those of the team's other workers (held until this worker is gone); None:
            a thread of its own.

    Raises:
        ImportError: on CUDA, Triton missing.
    """

    def __init__(self, ext, make: Callable[[int, int], object], device: torch.device, what: str, flag_kernels=None, team=None):
        self.device, self.cuda, self.what = device, device.type == "cuda", what
        if self.cuda and flag_kernels is None:  # Triton; raises ImportError without it, before any thread exists
            from writescope.attention import flag_kernels
        self._kernels = flag_kernels
        self.flags = torch.zeros(3, dtype=torch.int32, pin_memory=self.cuda)  # ready, done, timeout; outlives the thread (close)
        self._flag = self.flags.numpy()  # the same memory: read and written without a torch call on the issuing thread
        self._flags_dev = self._kernels.device_view(self.flags, device) if self.cuda else None
        if self.cuda:
            self._kernels.warm(self._flags_dev, FLAG_TIMEOUT)
        self.seq = 0  # jobs submitted (unbounded; the flags hold it modulo 2^32)
        self._inflight: deque = deque()  # (flag value, tensors the job reads or writes) until its done flag
        # the issuing thread's time in submit: in the native call (ns), and the calls; subclasses add
        # the time in all to submit_total_ns
        self.submit_total_ns = self.submit_wall_ns = self.submits = 0
        self.team = team  # held: its thread outlives this worker's jobs
        self.closed = False  # close() was called (a handle makes a new worker: moe/async_experts.py)
        # job_slot()'s: the slots (pinned int32), their device views, the values the stream keeps for its waits
        self._slot_host = torch.zeros(SLOT_CHUNK, dtype=torch.int32, pin_memory=self.cuda)
        self._slot_dev = self._kernels.device_view(self._slot_host, device) if self.cuda else None
        self._latch = torch.zeros(SLOT_CHUNK, dtype=torch.int32, device=device) if self.cuda else None
        self._free_slots = list(range(SLOT_CHUNK - 1, -1, -1))  # the lowest first
        self._ext, self._w = ext, make(team.address, team.post_address) if team is not None else make(0, 0)

    @property
    def threads(self) -> int:
        """The OpenMP threads of a job (the thread that runs it included)."""
        return self._w.threads

    @property
    def pinned(self) -> bool:
        """The thread that runs the jobs (the team's, if any) runs on the CPUs asked for (False
        until it has started, where none were asked for, or where the OS refused the list;
        ``OMP_PROC_BIND`` / ``GOMP_CPU_AFFINITY`` make OpenMP bind its team itself)."""
        return self.team.pinned if self.team is not None else bool(self._w.pinned)

    def _issue(self, keep, native_submit: Callable[[int], None], ready: bool = True) -> int:
        """Queue one job: check for earlier errors, release the finished jobs' tensors, keep ``keep``
        alive until this job is done, call ``native_submit(value)`` (the binding's submit with ready
        and done value ``value``), then set the ready flag: on the current stream with CUDA (after
        what was issued before), else on the host. ``ready`` False: the flag is left to
        :meth:`mark_ready` (the job's inputs are written after this call). Returns the job's value."""
        self.check()
        self._release_done()
        value = int32(self.seq + 1)
        self._inflight.append((value, keep))  # before the worker can see the job: it owns nothing
        # on CUDA the ready flag is set on the stream after the native submit (the worker waits for it)
        try:
            t0 = time.perf_counter_ns()  # (about 50 ns; the thread's CPU clock would be a system call)
            native_submit(value)
            self.submit_wall_ns += time.perf_counter_ns() - t0
            self.submits += 1
        except BaseException:
            self._inflight.pop()
            raise
        if self.cuda and ready:  # after the native submit: a refused job leaves no ready flag for the next to see early
            self._kernels.store_flag(self._flags_dev, FLAG_READY, value)
        self.seq += 1
        if not self.cuda and ready:
            self._flag[FLAG_READY] = value  # the inputs are already in host memory
        return value

    def job_slot(self) -> "JobSlot":
        """A free :class:`JobSlot` of this worker (its index goes back to the pool when the slot
        is collected: a graph dropped with its hook). ``SLOT_CHUNK`` slots, made with the worker
        (outside any capture).

        Raises:
            RuntimeError: all ``SLOT_CHUNK`` are in use.
        """
        if not self._free_slots:
            raise RuntimeError(f"the {self.what}'s {SLOT_CHUNK} job slots are all in use (one per captured stage)")
        i = self._free_slots.pop()
        slot = JobSlot(self, self._slot_host[i:i + 1].numpy(), None if self._slot_dev is None else self._slot_dev[i:i + 1],
                       None if self._latch is None else self._latch[i:i + 1])
        weakref.finalize(slot, self._free_slots.append, i)
        return slot

    def mark_ready(self, slot: "JobSlot") -> None:
        """The ready flag of the job whose value ``slot`` holds when this runs: on the current
        stream with CUDA (after what was issued before it: the job's input copies), at once on the
        host otherwise. What a CUDA graph captures (the kernel reads the slot when it runs)."""
        if self.cuda:
            self._kernels.store_flag_from(self._flags_dev, FLAG_READY, slot.dev, slot.latch)
        else:
            self._flag[FLAG_READY] = slot.host[0]

    def release(self, slot: "JobSlot") -> None:
        """Set the ready flag of the job ``slot`` names from the host, if the stream has not:
        for a job whose inputs will never come (its graph was not replayed), so that it, and the
        jobs queued behind it on the same thread, do not wait for them."""
        if slot.value is not None and not reached(int(self._flag[FLAG_READY]), slot.value):
            self._flag[FLAG_READY] = slot.value

    def consume_slot(self, slot: "JobSlot") -> None:
        """:meth:`consume` of the job whose value ``slot`` holds when the wait runs (see
        :meth:`mark_ready`).

        Raises:
            RuntimeError: a job failed or the host wait timed out (no CUDA); with CUDA, an earlier
                job failed (checked now: inside a graph's capture only at its replays' posts).
        """
        if self.cuda:
            self._kernels.wait_flag_for(self._flags_dev, FLAG_DONE, slot.latch, FLAG_TIMEOUT)
            self.check()
            return
        self.consume(int(slot.host[0]))

    def consume(self, seq: int) -> None:
        """Make the job's outputs safe to read: on CUDA the current stream waits for its done flag
        (the host does not); without CUDA the host waits (GIL released, at most ``WAIT_SECONDS``).

        Raises:
            RuntimeError: a job failed (this one or an earlier one) or the host wait timed out (no CUDA).
        """
        if self.cuda:
            self._kernels.wait_flag(self._flags_dev, FLAG_DONE, seq, FLAG_TIMEOUT)
            self.check()  # errors of earlier jobs (this one may still run)
            return
        if not self._ext.wait_flag(self.flags, FLAG_DONE, seq, WAIT_SECONDS):
            raise WorkerError(f"the {self.what} did not finish job {seq} in {WAIT_SECONDS:.0f} s")
        self.check()

    def wait_host(self, seq: int) -> bool:
        """This thread waits (GIL released, at most ``WAIT_SECONDS``) until job ``seq`` is done,
        whatever the device (after an error: the job may still read its inputs). Returns whether
        it finished."""
        return bool(self._ext.wait_flag(self.flags, FLAG_DONE, seq, WAIT_SECONDS))

    def done_value(self) -> int:
        """The done flag: the value of the last job finished (int32)."""
        return int(self._flag[FLAG_DONE])

    def check(self) -> None:
        """Raise the first error a job met since the last check (the worker goes on with later jobs).

        Raises:
            RuntimeError: with the job's error, or a device stream gave up waiting.
        """
        err = self._w.take_error()
        if err:
            raise WorkerError(f"{self.what}: {err}")
        if self._flag[FLAG_TIMEOUT]:
            self._flag[FLAG_TIMEOUT] = 0
            raise WorkerError(f"a device stream gave up waiting for the {self.what} (tens of seconds); "
                               "the outputs of that layer were not waited for")

    def _take_done(self) -> list[tuple]:
        """``(done value, seconds, *counts)`` of each job finished since the last call, in order."""
        return [tuple(d) for d in self._w.take_done()]

    def trace(self, on: bool) -> None:
        """Record each job's times from now on (``on``) or stop; see :meth:`take_trace`."""
        self._w.set_trace(bool(on))

    def take_trace(self) -> list[tuple[int, int, int, int]]:
        """``(sequence number, taken, inputs seen, done)`` of each job recorded since the last call,
        in order: when the worker took the job from its queue, when it saw the job's inputs (its
        ready flag), and when it was done (recorded just before its done flag is set), in
        nanoseconds of ``time.perf_counter_ns``'s clock (CLOCK_MONOTONIC; C++ ``steady_clock`` on
        Linux). The last 65,536 are kept."""
        return [tuple(t) for t in self._w.take_trace()]

    def totals(self) -> tuple:
        """``(jobs done, seconds running, *counts)`` since the start (the counts as the kind's
        ``take_done`` gives them)."""
        return tuple(self._w.totals())

    def _release_done(self) -> None:
        done = self.done_value()
        while self._inflight and reached(done, self._inflight[0][0]):
            self._inflight.popleft()

    def close(self) -> None:
        """Let the device reach the queued jobs, finish them and stop the thread (a job whose
        inputs never came fails); then raise what went wrong, if anything did. Again: a no-op
        (but for the check).

        Raises:
            RuntimeError: a job failed or a wait on the device timed out.
        """
        self.closed = True
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the jobs queued behind device work get their inputs first
        self._w.close()
        self._inflight.clear()
        self._closed()
        self.check()

    def __del__(self):
        # the native thread stops (joined) before the flags and the kept tensors it may still touch
        # are freed; an unclosed worker's errors are dropped here
        w = self.__dict__.get("_w")
        if w is not None:
            try:
                w.close()
            except Exception:  # noqa: BLE001 - nothing to raise to at collection
                pass

    def _closed(self) -> None:
        """A subclass's own bookkeeping to drop at close."""


class JobSlot:
    """One pinned int32 that names, to kernels that run later, the job whose ready flag they set
    and whose done flag they wait for (:meth:`FlagWorker.mark_ready`, :meth:`FlagWorker.consume_slot`):
    the host writes it before the kernels run, so a CUDA graph that captured them serves a new job
    at each replay (its kernels' arguments are fixed). A slot serves one job at a time: :meth:`set`
    first waits (host, at most ``WAIT_SECONDS``) for the job it named before, in case the device has
    not yet reached that job's ready flag (the host ahead by a whole pass), so that kernel never
    reads the next job's value; the wait after it reads the latch.

    Attributes:
        host: the slot, a one-element int32 numpy view of pinned memory; dev: its device view (None
            without CUDA); latch: one int32 in device memory where the ready flag's kernel keeps
            the value it read, for the wait (the host may rename the slot before the wait runs:
            :meth:`free` waits only for the done flag); value: the job it names now (None: none yet).
    """

    def __init__(self, worker: FlagWorker, host, dev, latch):
        self.worker, self.host, self.dev, self.latch, self.value = worker, host, dev, latch, None

    def free(self) -> None:
        """Wait until the job named before (if any) is done (the host reads its done flag; a wait
        only where the device has not reached it yet).

        Raises:
            RuntimeError: it did not finish within ``WAIT_SECONDS``.
        """
        prev = self.value
        if prev is not None and not reached(self.worker.done_value(), prev) and not self.worker.wait_host(prev):
            raise WorkerError(f"the {self.worker.what} did not finish job {prev} in {WAIT_SECONDS:.0f} s "
                               "(a job slot is named again only after its last job)")

    def set(self, value: int) -> None:
        """Name job ``value`` (int32, as the flags hold it), after :meth:`free`.

        Raises:
            RuntimeError: the job named before did not finish within ``WAIT_SECONDS``.
        """
        self.free()
        self.host[0] = value
        self.value = value
