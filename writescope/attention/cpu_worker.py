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
A job that fails still sets its done flag (nothing waits forever) and its error is raised by the
next call of :meth:`NativeWorker.check`. The GPU wait gives up after about ``WAIT_SECONDS`` and
records a timeout that ``check`` raises too.
"""

from __future__ import annotations

from collections import deque

import torch

from writescope.attention import cpu_kernel

WAIT_SECONDS = 60.0  # the longest a stream or the host waits for one job
_FLAG_READY, _FLAG_DONE = 0, 1


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
            self._timeout = torch.zeros(1, dtype=torch.int32, device=device)
        self._ext, self._w = ext, ext.Worker(threads)
        self.flags = torch.zeros(2, dtype=torch.int32, pin_memory=self.cuda)
        self._flags_dev = self._kernels.device_view(self.flags) if self.cuda else None
        if self.cuda:
            self._kernels.warm(self._flags_dev, self._timeout)
        self.seq = 0
        self._inflight: deque = deque()  # (seq, tensors the job reads or writes) until its done flag
        self._reported = 0  # stats: the done value of the last job reported by poll_stats

    @property
    def threads(self) -> int:
        return self._w.threads

    def submit(self, q: torch.Tensor, kv: list, scale: float, out: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Queue one layer: ``q [B, kv_heads, G, dk]`` (host memory; on CUDA being copied there on
        the current stream), ``kv`` per sequence ``(k, v)`` or None as for
        :func:`writescope.attention.cpu_kernel.attend`, ``out`` the pinned ``(o, lse)`` to write.
        On CUDA the ready flag is set on the current stream after whatever was issued before (q's
        copy). Returns the job's sequence number. The tensors are kept alive until it is done."""
        self._release_done()
        self.seq = (self.seq + 1) & 0x7FFFFFFF or 1
        rows = [i for i, x in enumerate(kv) if x is not None and x[0].shape[1] > 0]
        if self.cuda:
            self._kernels.store_flag(self._flags_dev, _FLAG_READY, self.seq)
        self._w.submit(q, [kv[i][0] for i in rows], [kv[i][1] for i in rows], rows, cpu_kernel.CHUNK, float(scale),
                       cpu_kernel.requested_path(), out[0], out[1], self.flags, _FLAG_READY, self.seq, _FLAG_DONE, self.seq)
        if not self.cuda:
            self.flags[_FLAG_READY] = self.seq  # q is already in host memory
        self._inflight.append((self.seq, q, kv, out))
        return self.seq

    def consume(self, seq: int) -> None:
        """Make the job's outputs safe to read: on CUDA the current stream waits for its done flag
        (the host does not); without CUDA the host waits (GIL released).

        Raises:
            RuntimeError: the job failed or the host wait timed out (no CUDA).
        """
        if self.cuda:
            self._kernels.wait_flag(self._flags_dev, _FLAG_DONE, seq, self._timeout)
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
        return int(self.flags[_FLAG_DONE])

    def check(self) -> None:
        """Raise the first error a job met since the last check (the worker goes on with later jobs).

        Raises:
            RuntimeError: with the job's error.
        """
        err = self._w.take_error()
        if err:
            raise RuntimeError(f"CPU attention worker: {err}")

    def poll_stats(self) -> tuple[float, int] | None:
        """``(seconds, keys)`` of the last job done since the previous poll, or None."""
        _, _, _, last_s, last_keys, last_value = self._w.stats()
        if last_value == self._reported or last_value == 0:
            return None
        self._reported = last_value
        return last_s, last_keys

    def totals(self) -> tuple[int, float, int]:
        """(jobs done, seconds attending, keys attended) since the start."""
        jobs, secs, keys, *_ = self._w.stats()
        return jobs, secs, keys

    def _release_done(self) -> None:
        done = self.done_value()
        while self._inflight and ((done - self._inflight[0][0]) & 0xFFFFFFFF) < 0x80000000:
            self._inflight.popleft()

    def close(self) -> None:
        """Finish the queued jobs and stop the thread (a job whose q never came fails); then raise
        a GPU wait's timeout, if one was recorded.

        Raises:
            RuntimeError: a wait on the device timed out.
        """
        self._w.close()
        self._inflight.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            if int(self._timeout.item()):
                raise RuntimeError(f"a device stream gave up waiting for the CPU attention worker after about {WAIT_SECONDS:.0f} s")
