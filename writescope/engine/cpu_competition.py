"""Other processes' CPU use while a run is timed, measured: whether its timings met competition.

A run's timings on the CPU suffer many times over when other processes keep its CPUs busy (torch's
intra-op threads and OpenMP's spinning wait on one another's time slices; see
:func:`writescope.engine.threads.busy_note`). The load average says so only roughly: it is a
1-minute mean, taken before the run, so it misses load that starts during a long kernel build
and still reports load that ended before a quiet run. This module measures the run itself: the
busy time of the CPUs this process may use (Linux ``/proc/stat``: user, nice, system, irq,
softirq and steal ticks), less this process's own CPU time and that of the children it waited
for (``os.times``), per second of wall time, is the CPUs other processes (or the hypervisor)
took while it ran.
"""

from __future__ import annotations

import os
import time
from typing import Callable


def busy_ticks(stat: str, cpus: set[int]) -> int | None:
    """The busy clock ticks (user, nice, system, irq, softirq, steal) of the CPUs ``cpus`` in
    ``stat``, the text of ``/proc/stat``; None when it names none of them."""
    total, seen = 0, 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in rest.split()] + [0] * 8
        total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system . iowait(not busy) irq softirq steal
        seen += 1
    return total if seen else None


def _read_stat() -> str | None:
    try:
        with open("/proc/stat") as f:
            return f.read()
    except OSError:
        return None


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _affinity() -> set[int]:
    mask = getattr(os, "sched_getaffinity", None)
    return set(mask(0)) if mask is not None else set(range(os.cpu_count() or 1))


class CpuCompetition:
    """Started when made; :meth:`others` and :meth:`note` say what other processes took since.

    Args (for tests; the defaults read this machine): ``read_stat`` returns ``/proc/stat``'s text
    or None; ``own_seconds`` this process's CPU seconds so far; ``clock`` wall seconds; ``cpus``
    the CPUs this process may use; ``tick`` seconds per clock tick.
    """

    def __init__(self, read_stat: Callable[[], str | None] = _read_stat, own_seconds: Callable[[], float] = _own_seconds,
                 clock: Callable[[], float] = time.monotonic, cpus: set[int] | None = None, tick: float | None = None):
        self._read, self._own, self._clock = read_stat, own_seconds, clock
        self.cpus = cpus if cpus is not None else _affinity()
        if tick is None:
            try:
                tick = 1.0 / os.sysconf("SC_CLK_TCK")
            except (AttributeError, ValueError, OSError):
                tick = 0.01
        self._tick = tick
        self._start = self._sample()

    def _sample(self):
        stat = self._read()
        ticks = busy_ticks(stat, self.cpus) if stat is not None else None
        return None if ticks is None else (ticks, self._own(), self._clock())

    @property
    def measurable(self) -> bool:
        """Whether the start could be read (``/proc/stat`` with this process's CPUs)."""
        return self._start is not None

    def others(self) -> float | None:
        """The CPUs (a mean over the wall time since the start) that other processes kept busy among
        this process's CPUs, at least 0; None where ``/proc/stat`` cannot be read or no time passed."""
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        busy = (end[0] - self._start[0]) * self._tick
        own = end[1] - self._start[1]
        return max(0.0, busy - own) / (end[2] - self._start[2])

    def note_or(self, fallback: str | None, remedy: str) -> str | None:
        """:meth:`note` where the run could be measured, else ``fallback`` (the load average's
        note, :func:`writescope.engine.threads.busy_note`, taken before the run)."""
        return self.note(remedy) if self.measurable else fallback

    def note(self, remedy: str) -> str | None:
        """A note when other processes took at least half a CPU, and at least a quarter of this
        process's CPUs, while the run was timed (``remedy``: what the command can set); None
        otherwise or where it cannot be measured."""
        taken = self.others()
        n = len(self.cpus)
        if taken is None or taken < max(0.5, 0.25 * n):
            return None
        return (f"note: other processes kept {taken:.1f} of the {n} CPUs this process may use busy while it was timed: "
                f"these timings suffer (torch's threads most: {remedy} may help)")
