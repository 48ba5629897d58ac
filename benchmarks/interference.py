"""Timing kernels under a load that comes and goes: other processes spinning on the cores (what a
decode step's thread issuing GPU work, or a driver thread, does to a CPU kernel's threads), and
variants' calls taking turns so the load weighs on each alike (benchmarks/cpu_attention.py and
benchmarks/cpu_experts.py, ``--busy``)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def timed_in_turns(fns: list, repeats: int) -> list[tuple[float, float, float]]:
    """``(median, min, max)`` seconds of each of ``fns`` over ``repeats`` calls, after one warm-up
    call each, their calls taking turns (one of each per round), so a load that comes and goes
    weighs on all of them alike."""
    for fn in fns:
        fn()
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            ts[i].append(time.perf_counter() - t0)
    return [(statistics.median(t), min(t), max(t)) for t in ts]


class Busy:
    """``n`` other processes spinning on the CPU for the duration of a ``with`` block."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
