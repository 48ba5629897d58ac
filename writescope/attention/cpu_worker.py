"""The native CPU attention worker: a persistent C++ thread (cpu_worker.h, over the generic
native/flag_worker.h) that runs one layer's CPU attention per job, in order, and never takes the
GIL (docs/DESIGN.md section 10).

The hand-offs (a pinned ready flag the stream or the host sets once q is in host memory, a done
flag the stream or the host waits on), the errors (a failed job writes NaN and its error is raised
by the next ``check``, called by every ``submit``, ``consume`` and ``close``) and the sequence
numbers (modulo 2^32) are writescope.native.flag_worker's, shared with the host-expert worker.
"""

from __future__ import annotations

import os
import time

import torch

from writescope.attention import cpu_kernel
from writescope.env import env_choice, env_int
from writescope.native.flag_worker import FLAG_DONE as _FLAG_DONE
from writescope.native.flag_worker import FLAG_READY as _FLAG_READY
from writescope.native.flag_worker import FLAG_TIMEOUT as _FLAG_TIMEOUT
from writescope.native.flag_worker import WAIT_SECONDS, FlagWorker
from writescope.native.flag_worker import int32 as _int32
from writescope.native.flag_worker import reached as _reached

__all__ = ["NativeWorker", "WAIT_SECONDS", "pin_wanted", "preread_from_env", "worker_cpus", "_FLAG_READY", "_FLAG_DONE", "_FLAG_TIMEOUT",
           "_int32", "_reached"]


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
    mib = env_int(PREREAD_ENV, 0, 65536, "use MiB from 0 (none, the default) to 65536")
    return (mib or 0) << 20


class NativeWorker(FlagWorker):
    """One worker thread (its own, or a team's) whose jobs run on ``threads`` OpenMP threads (that thread included).
    ``consume``, ``wait_host``, ``done_value``, ``check``, ``trace``, ``take_trace``, ``totals``
    (jobs done, seconds attending, keys attended), ``threads``, ``pinned`` and ``close`` are
    :class:`writescope.native.flag_worker.FlagWorker`'s.

    Args:
        threads: CPU threads of the attention.
        device: the device whose stream hands q over and consumes the results (CPU: the host does).
        team: a :class:`writescope.native.team.CpuTeam` to run the jobs on, with the team's other
            workers' (None: a thread of its own, on ``WRITESCOPE_CPU_PIN``'s CPUs).

    Raises:
        RuntimeError: the C++ kernel cannot be built; ImportError: on CUDA, Triton is missing.
    """

    def __init__(self, threads: int, device: torch.device, team=None):
        ext = cpu_kernel._extension()
        if ext is None:
            raise RuntimeError("the CPU attention kernel could not be built: no native worker")
        self._batch: dict[int, int] = {}  # flag value -> the job's batch size, for take_done
        self.cpus = worker_cpus(threads)  # asked for; whether the OS agreed: `pinned`
        self.preread_bytes = preread_from_env()
        super().__init__(ext, lambda ex, post: ext.Worker(threads, self.cpus, self.preread_bytes, ex, post), device, "CPU attention worker",
                         team=team)

    def submit(self, q: torch.Tensor, kv: list, scale: float, out: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Queue one layer: ``q [B, kv_heads, G, dk]`` (host memory; on CUDA being copied there on
        the current stream), ``kv`` per sequence ``(k, v)`` or None as for
        :func:`writescope.attention.cpu_kernel.attend`, ``out`` the pinned ``(o, lse)`` to write.
        On CUDA the ready flag is set on the current stream after whatever was issued before (q's
        copy). Returns the job's sequence number. The tensors are kept alive until it is done.

        Raises:
            RuntimeError: an earlier job failed, the worker is closed, or the inputs do not match
                (the binding names what).
        """
        entered = time.perf_counter_ns()
        try:
            rows = [i for i, x in enumerate(kv) if x is not None and x[0].shape[1] > 0]
            value = self._issue((q, kv, out), lambda v: self._w.submit(
                q, [kv[i][0] for i in rows], [kv[i][1] for i in rows], rows, cpu_kernel.CHUNK, float(scale), cpu_kernel.requested_path(),
                out[0], out[1], self.flags, _FLAG_READY, v, _FLAG_DONE, v))
            self._batch[value] = len(kv)
            return value
        finally:
            self.submit_total_ns += time.perf_counter_ns() - entered

    def take_done(self) -> list[tuple[float, int, int]]:
        """``(seconds, keys, batch)`` of each job finished since the last call, in order."""
        return [(secs, keys, self._batch.pop(value, 0)) for value, secs, keys in self._take_done()]

    def preread_total(self) -> int:
        """Bytes the worker's threads read ahead while jobs waited for their q, since the start."""
        return int(self._w.preread_total)

    def _closed(self) -> None:
        self._batch.clear()
