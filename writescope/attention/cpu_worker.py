"""The native CPU attention worker: a persistent C++ thread (cpu_worker.h) that runs one layer's
CPU attention per job, in order, and never takes the GIL (docs/DESIGN.md section 10).

Hand-offs, all through one pinned int32 flag pair per worker (sequence numbers, modulo 2^32):
- ``ready``: the job's q is in host memory. On CUDA the stream sets it after q's copy (a one-CTA
  Triton kernel storing into the pinned flag through its device address); without CUDA the host
  sets it at submit.
- ``done``: the job's (o, lse) are in their pinned buffers. On CUDA the stream waits for it with a
  one-CTA Triton kernel spinning on the flag (``cuStreamWaitValue32`` hung on the H200 machine:
  docs/HARDWARE.md), so the thread that issues the step does not wait; without CUDA the host
  waits (GIL released).
A job that fails fills its outputs with NaN, still sets its done flag (nothing waits forever), and
its error is raised by the next :meth:`NativeWorker.check` (called by every ``submit``,
``consume`` and ``close``). The GPU wait gives up after ``flag_kernels.MAX_POLLS`` polls (tens of
seconds) and writes a third pinned flag, which ``check`` reads (no device sync) and raises.
Sequence numbers count without bound in Python; the flags hold them modulo 2^32 as int32, and
every comparison is a signed 32-bit difference (valid while fewer than 2^31 jobs are in flight).
"""

from __future__ import annotations

import os
import time
from collections import deque

import torch

from writescope.attention import cpu_kernel
from writescope.env import env_choice

WAIT_SECONDS = 60.0  # the longest a stream or the host waits for one job
_FLAG_READY, _FLAG_DONE, _FLAG_TIMEOUT = 0, 1, 2


def pin_wanted() -> bool:
    """``WRITESCOPE_CPU_PIN``: ``on`` keeps the worker and its OpenMP team off one CPU of those the
    process may use (the lowest), which is left to the thread that issues the step; ``off`` (the
    default) lets the OS place them. Waking the worker (a submit) could otherwise put it on the
    issuing thread's CPU, ahead of that thread.

    Raises:
        ValueError: another value (names it).
    """
    return env_choice("WRITESCOPE_CPU_PIN", ("off", "on")) == "on"


def worker_cpus(threads: int) -> list[int]:
    """The CPUs the worker is pinned to under ``WRITESCOPE_CPU_PIN=on``: those this process may
    use but the lowest, when ``threads`` fit on them; else none (not pinned)."""
    if not pin_wanted() or not hasattr(os, "sched_getaffinity"):  # no affinity masks on this OS: not pinned
        return []
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[1:] if len(allowed) > 1 and threads <= len(allowed) - 1 else []


PREREAD_ENV = "WRITESCOPE_CPU_PREREAD"


def preread_from_env() -> int:
    """``WRITESCOPE_CPU_PREREAD``: MiB of a queued job's KV its threads read while they wait for its
    q (the bytes the job reads first, so that they are in the caches when it starts; cpu_kernel.cpp,
    ``preread``), in bytes; unset or 0: none (the default), the worker only spins.

    Raises:
        ValueError: not an integer from 0 to 65536 (names the value).
    """
    raw = os.environ.get(PREREAD_ENV, "").strip()
    if not raw:
        return 0
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if not 0 <= mib <= 65536:
        raise ValueError(f"{PREREAD_ENV}={raw!r}: use MiB from 0 (none, the default) to 65536")
    return mib << 20


def _int32(n: int) -> int:
    """n modulo 2^32, as a signed int32 (what the flags hold)."""
    return (n + 2**31) % 2**32 - 2**31


def _reached(flag: int, value: int) -> bool:
    """flag has reached value, both int32, modulo 2^32."""
    return (flag - value) % 2**32 < 2**31


class NativeWorker:
    """One worker thread with ``threads`` OpenMP threads of its own (the worker thread included).

    Args:
        threads: CPU threads of the attention.
        device: the device whose stream hands q over and consumes the results (CPU: the host does).

    Raises:
        RuntimeError: the C++ kernel cannot be built, or on CUDA Triton is missing.
    """

    def __init__(self, threads: int, device: torch.device):
        ext = cpu_kernel._extension()
        if ext is None:
            raise RuntimeError("the CPU attention kernel could not be built: no native worker")
        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:
            from writescope.attention import flag_kernels  # Triton; raises ImportError without it

            self._kernels = flag_kernels
        self.flags = torch.zeros(3, dtype=torch.int32, pin_memory=self.cuda)  # ready, done, timeout; outlives the thread (close)
        self._flag = self.flags.numpy()  # the same memory: read and written without a torch call on the issuing thread
        self._flags_dev = self._kernels.device_view(self.flags, device) if self.cuda else None
        if self.cuda:
            self._kernels.warm(self._flags_dev, _FLAG_TIMEOUT)
        self.seq = 0  # jobs submitted (unbounded; the flags hold it modulo 2^32)
        self._inflight: deque = deque()  # (flag value, tensors the job reads or writes) until its done flag
        self._batch: dict[int, int] = {}  # flag value -> the job's batch size, for take_done
        # the issuing thread's time in submit: in all and in the native call (ns), and the calls
        self.submit_total_ns = self.submit_wall_ns = self.submits = 0
        self.cpus = worker_cpus(threads)  # asked for; whether the OS agreed: `pinned`
        self.preread_bytes = preread_from_env()
        self._ext, self._w = ext, ext.Worker(threads, self.cpus, self.preread_bytes)

    @property
    def threads(self) -> int:
        return self._w.threads

    @property
    def pinned(self) -> bool:
        """The worker thread runs on ``cpus`` (False until it has started, where none were asked
        for, or where the OS refused the list; ``OMP_PROC_BIND`` / ``GOMP_CPU_AFFINITY`` make
        OpenMP bind its team itself)."""
        return bool(self._w.pinned)

    def submit(self, q: torch.Tensor, kv: list, scale: float, out: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Queue one layer: ``q [B, kv_heads, G, dk]`` (host memory; on CUDA being copied there on
        the current stream), ``kv`` per sequence ``(k, v)`` or None as for
        :func:`writescope.attention.cpu_kernel.attend`, ``out`` the pinned ``(o, lse)`` to write.
        On CUDA the ready flag is set on the current stream after whatever was issued before (q's
        copy). Returns the job's sequence number. The tensors are kept alive until it is done."""
        entered = time.perf_counter_ns()
        try:
            return self._submit(q, kv, scale, out)
        finally:
            self.submit_total_ns += time.perf_counter_ns() - entered

    def _submit(self, q, kv, scale, out) -> int:
        self.check()
        self._release_done()
        value = _int32(self.seq + 1)
        rows = [i for i, x in enumerate(kv) if x is not None and x[0].shape[1] > 0]
        self._inflight.append((value, (q, kv, out)))  # before the worker can see the job: it owns nothing
        try:
            if self.cuda:
                self._kernels.store_flag(self._flags_dev, _FLAG_READY, value)
            t0 = time.perf_counter_ns()  # (about 50 ns; the thread's CPU clock would be a system call)
            self._w.submit(q, [kv[i][0] for i in rows], [kv[i][1] for i in rows], rows, cpu_kernel.CHUNK, float(scale),
                           cpu_kernel.requested_path(), out[0], out[1], self.flags, _FLAG_READY, value, _FLAG_DONE, value)
            self.submit_wall_ns += time.perf_counter_ns() - t0
            self.submits += 1
        except BaseException:
            self._inflight.pop()
            raise
        self.seq += 1
        self._batch[value] = len(kv)
        if not self.cuda:
            self._flag[_FLAG_READY] = value  # q is already in host memory
        return value

    def consume(self, seq: int) -> None:
        """Make the job's outputs safe to read: on CUDA the current stream waits for its done flag
        (the host does not); without CUDA the host waits (GIL released).

        Raises:
            RuntimeError: the job failed or the host wait timed out (no CUDA).
        """
        if self.cuda:
            self._kernels.wait_flag(self._flags_dev, _FLAG_DONE, seq, _FLAG_TIMEOUT)
            self.check()  # errors of earlier jobs (this one may still run)
            return
        if not self._ext.wait_flag(self.flags, _FLAG_DONE, seq, WAIT_SECONDS):
            raise RuntimeError(f"the CPU attention worker did not finish job {seq} in {WAIT_SECONDS:.0f} s")
        self.check()

    def wait_host(self, seq: int) -> bool:
        """This thread waits (GIL released, at most ``WAIT_SECONDS``) until job ``seq`` is done,
        whatever the device (after an error: the job may still read the cache). Returns whether
        it finished."""
        return bool(self._ext.wait_flag(self.flags, _FLAG_DONE, seq, WAIT_SECONDS))

    def done_value(self) -> int:
        return int(self._flag[_FLAG_DONE])

    def check(self) -> None:
        """Raise the first error a job met since the last check (the worker goes on with later jobs).

        Raises:
            RuntimeError: with the job's error.
        """
        err = self._w.take_error()
        if err:
            raise RuntimeError(f"CPU attention worker: {err}")
        if self._flag[_FLAG_TIMEOUT]:
            self._flag[_FLAG_TIMEOUT] = 0
            raise RuntimeError("a device stream gave up waiting for the CPU attention worker (tens of seconds); "
                               "the outputs of that layer were not waited for")

    def take_done(self) -> list[tuple[float, int, int]]:
        """``(seconds, keys, batch)`` of each job finished since the last call, in order."""
        out = []
        for value, secs, keys in self._w.take_done():
            out.append((secs, keys, self._batch.pop(value, 0)))
        return out

    def trace(self, on: bool) -> None:
        """Record each job's times from now on (``on``) or stop; see :meth:`take_trace`."""
        self._w.set_trace(bool(on))

    def take_trace(self) -> list[tuple[int, int, int, int]]:
        """``(sequence number, taken, q seen, done)`` of each job recorded since the last call, in
        order: when the worker took the job from its queue, when it saw the job's q (its ready
        flag), and when it was done (recorded just before its done flag is set), in nanoseconds of ``time.perf_counter_ns``'s clock
        (CLOCK_MONOTONIC; C++ ``steady_clock`` on Linux). The last 65,536 are kept."""
        return [tuple(t) for t in self._w.take_trace()]

    def preread_total(self) -> int:
        """Bytes the worker's threads read ahead while jobs waited for their q, since the start."""
        return int(self._w.preread_total)

    def totals(self) -> tuple[int, float, int]:
        """(jobs done, seconds attending, keys attended) since the start."""
        return tuple(self._w.totals())

    def _release_done(self) -> None:
        done = self.done_value()
        while self._inflight and _reached(done, self._inflight[0][0]):
            self._inflight.popleft()

    def close(self) -> None:
        """Let the device reach the queued jobs, finish them and stop the thread (a job whose q
        never came fails); then raise what went wrong, if anything did.

        Raises:
            RuntimeError: a job failed or a wait on the device timed out.
        """
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the jobs queued behind device work get their q first
        self._w.close()
        self._inflight.clear()
        self._batch.clear()
        self.check()
