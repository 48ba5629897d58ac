"""CPU threads: how many the CPU attention and the host experts use (docs/DESIGN.md section 6).

The two never run at the same time within a decode step (a layer's attention finishes before its
experts start), so each may use most of the cores; what they share the cores with is the thread
that launches GPU work. With CUDA the CPU attention runs in a worker thread while the main thread
streams the load region and launches its kernels, so by default it leaves that thread one core
(the one-layer benchmarks in benchmarks/results/split_attention.md ran it with 15 of 16 threads).
Host experts run on the main thread after the device experts are issued: all threads.
"""

from __future__ import annotations

import glob
import os
from contextlib import contextmanager

import torch

from writescope.env import env_int

THREADS_ENV = "WRITESCOPE_CPU_THREADS"


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (a ``Cpus_allowed_list``) as a set of CPU numbers.

    Raises:
        ValueError: not such a list.
    """
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def process_cpus() -> set[int]:
    """The CPUs any thread of this process may run on: the union of its threads' allowed lists
    (``/proc/self/task/*/status``; a library may have bound the calling thread alone to one CPU,
    as OpenMP does under ``OMP_PROC_BIND``), else the calling thread's affinity mask, else all."""
    cpus: set[int] = set()
    for path in glob.glob("/proc/self/task/*/status"):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        cpus |= parse_cpu_list(line.split(":", 1)[1])
        except (OSError, ValueError):
            continue
    if cpus:
        return cpus
    mask = getattr(os, "sched_getaffinity", None)
    return set(mask(0)) if mask is not None else set(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on (:func:`process_cpus`)."""
    return len(process_cpus())


BUSY_REMEDY = "OMP_WAIT_POLICY=passive, OMP_NUM_THREADS=1, or fewer --cpu-threads"  # what generate can set


def busy_note(remedy: str = BUSY_REMEDY) -> str | None:
    """A note when the machine's 1-minute load average exceeds the CPUs this process may use (other
    processes compete for them: torch's intra-op threads then wait on one another, and timings
    can be many times slower); None otherwise, or where the OS gives no load average. Take it
    before a run's own threads add to the load; ``remedy``: what the command can set.

    Why ``OMP_WAIT_POLICY=passive`` first: OpenMP's threads spin after each parallel region, and
    spinning threads on busy cores wait for one another's time slices. On the 2-core development
    machine under another process's load (a second torch process running short parallel ops), the
    ``gpu`` policy on the CPU took 138-439 ms a decode step of tiny-qwen3-moe against 7-9 ms idle,
    and 6.8 ms with ``OMP_WAIT_POLICY=passive`` (``writescope bench --model tiny-qwen3-moe --batch 2
    --context 1k --steps 8 --policies gpu,cpu,static:0.5,resident --repeats 1``, tenth session)
    (``cpu`` and ``static`` suffered less: their CPU attention pool makes more OpenMP threads than
    CPUs, and libgomp then spins briefly)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cpus = usable_cpus()
    if load <= cpus:
        return None
    return (f"note: the load average ({load:.1f}) exceeds the {cpus} CPUs this process may use: other processes compete for "
            f"them and these timings suffer (torch's threads most: {remedy} may help)")


def check_cpu_threads(n: int | None, name: str = "cpu_threads") -> None:
    """A CPU attention thread count given by a caller: 1 to :func:`usable_cpus` (as
    ``WRITESCOPE_CPU_THREADS``, which a given count overrides); None: not given.

    Raises:
        ValueError: outside that range (names ``name``, the value and the range).
    """
    if n is None:
        return
    cpus = usable_cpus()
    if not 1 <= n <= cpus:
        raise ValueError(f"{name} must be 1 to {cpus} (the CPUs this process may use), got {n}")


def attention_threads_from_env() -> int | None:
    """``WRITESCOPE_CPU_THREADS``: the CPU attention's threads, 1 to the CPUs this process may use;
    unset or empty: None (the default below).

    Raises:
        ValueError: not such an integer (names the value and the range).
    """
    cpus = usable_cpus()
    return env_int(THREADS_ENV, 1, cpus, f"use an integer from 1 to {cpus} (the CPUs this process may use), or leave it unset")


def default_attention_threads(device: torch.device) -> int:
    """Threads for CPU attention: ``WRITESCOPE_CPU_THREADS`` when set, else torch's intra-op count,
    less one with CUDA (see module doc).

    Raises:
        ValueError: a bad ``WRITESCOPE_CPU_THREADS``.
    """
    n = attention_threads_from_env()
    if n is not None:
        return n
    n = torch.get_num_threads()
    return max(1, n - 1) if torch.device(device).type == "cuda" else n


def default_expert_threads(device: torch.device) -> int:
    """Threads for the host experts' GEMMs: torch's intra-op count."""
    return torch.get_num_threads()


@contextmanager
def intra_op_threads(n: int):
    """Run the block with ``n`` intra-op threads on this thread, then restore the previous count."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)
