"""Timing kernels under a load that comes and goes: other processes spinning on the cores (what a
decode step's thread issuing GPU work, or a driver thread, does to a CPU kernel's threads), and
variants' calls taking turns so the load weighs on each alike (benchmarks/cpu_attention.py and
benchmarks/cpu_experts.py, ``--busy``); a call looped on a thread as the load (benchmarks/link_read.py)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
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


class Loop:
    """``fn`` called again and again on a thread for a ``with`` block; ``gbs`` its rate over the
    block (``nbytes`` a call), counted from the first call that starts inside it."""

    def __init__(self, fn, nbytes: int):
        self.fn, self.nbytes, self.calls, self.seconds = fn, nbytes, 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self):
        t0 = time.perf_counter()
        try:
            while not self._stop.is_set():
                self.fn()
                self.calls += 1
        except BaseException as e:  # noqa: BLE001 (reported by __exit__)
            self.error = e
        self.seconds = time.perf_counter() - t0

    def __enter__(self):
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"the background load failed: {self.error}") from self.error

    @property
    def gbs(self) -> float:
        return self.calls * self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
