"""Other processes' CPU use while a run is timed, measured: whether its timings met competition.

A run's timings on the CPU suffer many times over when other processes keep its CPUs busy (torch's
intra-op threads and OpenMP's spinning wait on one another's time slices; see
:func:`writescope.engine.threads.busy_note`). The load average says so only roughly: it is a
1-minute mean, taken before the run, so it misses load that starts during a long kernel build
and still reports load that ended before a quiet run. This module measures the run itself: the
busy time of the CPUs this process may use (Linux ``/proc/stat``: user, nice, system, irq,
softirq and steal ticks), less this process's own CPU time and that of the children it waited
for (``os.times``), per second of wall time, is the CPUs other processes (or the hypervisor)
took while it ran. It counts as competition only where those CPUs were nearly saturated (idle
under a quarter of them): others on CPUs that stood idle anyway slowed nothing.

A container's CPU quota (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``) is another limit the
affinity mask does not show: the time the quota throttled this process (``cpu.stat``'s
``throttled_usec``, v1 ``throttled_time``) is reported where it is a tenth of the run or more.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from writescope.engine.threads import process_cpus


def min_wall_s(cpus: int, tick: float) -> float:
    """The shortest run measured: where the count's error (a tick at each end of each CPU's count)
    is at most a quarter of the competition threshold (:meth:`CpuCompetition.note`: half a CPU or
    a quarter of the CPUs), 0.32 s with 10 ms ticks on any count of CPUs from 2. It was a fixed
    second, so runs under a second (a short ``generate`` on a tiny preset, its steps 9x slower
    beside one busy core) got no note."""
    return 8 * cpus * tick / max(0.5, 0.25 * cpus)

CGROUP = "/sys/fs/cgroup"


def cpu_ticks(stat: str, cpus: set[int]) -> tuple[int, int] | None:
    """(busy, idle) clock ticks of the CPUs ``cpus`` in ``stat``, the text of ``/proc/stat``
    (busy: user, nice, system, irq, softirq, steal; idle: idle, iowait); None unless it names
    every one of them, or where a line cannot be read."""
    busy = idle = 0
    seen = set()
    try:
        for line in stat.splitlines():
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
                continue
            v = [int(x) for x in rest.split()] + [0] * 8
            busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
            idle += v[3] + v[4]
            seen.add(int(name[3:]))
    except ValueError:
        return None
    return (busy, idle) if seen == cpus else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _throttled_s(cgroup: str = CGROUP) -> float | None:
    """Seconds the CPU quota has throttled this process's cgroup so far, None where there is no
    quota: cgroup v2 (``cpu.max`` not ``max``; ``cpu.stat``'s ``throttled_usec``), else cgroup v1's
    cpu controller (``cpu/cpu.cfs_quota_us`` not -1; ``cpu/cpu.stat``'s ``throttled_time``, ns)."""
    quota = _read(os.path.join(cgroup, "cpu.max"))
    if quota is not None:
        return None if quota.split()[:1] == ["max"] else _stat_value(os.path.join(cgroup, "cpu.stat"), "throttled_usec", 1e-6)
    for v1 in ("cpu", "cpu,cpuacct"):  # where the v1 cpu controller is mounted
        quota = _read(os.path.join(cgroup, v1, "cpu.cfs_quota_us"))
        if quota is not None:
            if quota.strip() in ("", "-1"):
                return None
            return _stat_value(os.path.join(cgroup, v1, "cpu.stat"), "throttled_time", 1e-9)
    return None


def _stat_value(path: str, key: str, unit: float) -> float | None:
    """``key``'s value in a cgroup ``cpu.stat`` file times ``unit`` (to seconds); None where absent."""
    for line in (_read(path) or "").splitlines():
        k, _, value = line.partition(" ")
        if k == key and value.strip().isdigit():
            return int(value) * unit
    return None


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuCompetition:
    """Started when made; :meth:`others` and :meth:`note` say what other processes took since.

    Args (for tests; the defaults read this machine): ``read_stat`` returns ``/proc/stat``'s text
    or None; ``own_seconds`` this process's CPU seconds so far; ``clock`` wall seconds; ``cpus``
    the CPUs this process may use; ``tick`` seconds per clock tick; ``throttled`` the seconds a
    CPU quota has throttled it so far (None: no quota).
    """

    def __init__(self, read_stat: Callable[[], str | None] = lambda: _read("/proc/stat"),
                 own_seconds: Callable[[], float] = _own_seconds, clock: Callable[[], float] = time.monotonic,
                 cpus: set[int] | None = None, tick: float | None = None,
                 throttled: Callable[[], float | None] = _throttled_s):
        self._read, self._own, self._clock, self._throttled = read_stat, own_seconds, clock, throttled
        self.cpus = cpus if cpus is not None else process_cpus()
        if tick is None:
            try:
                tick = 1.0 / os.sysconf("SC_CLK_TCK")
            except (AttributeError, ValueError, OSError):
                tick = 0.01
        self._tick = tick
        self.min_wall = min_wall_s(max(1, len(self.cpus)), tick)  # shorter runs are not measured (seconds)
        self._start = self._sample()

    def _sample(self):
        stat = self._read()
        ticks = cpu_ticks(stat, self.cpus) if stat is not None else None
        return None if ticks is None else (ticks, self._own(), self._clock(), self._throttled())

    @property
    def measurable(self) -> bool:
        """Whether the start could be read (``/proc/stat`` with every one of this process's CPUs)."""
        return self._start is not None

    def _since(self):
        end = self._sample()
        if self._start is None or end is None or end[2] - self._start[2] < self.min_wall:
            return None
        return end

    def others(self) -> float | None:
        """The CPUs (a mean over the wall time since the start) that other processes kept busy among
        this process's CPUs, at least 0; None where ``/proc/stat`` cannot be read or the run was
        shorter than :attr:`min_wall` (:func:`min_wall_s`)."""
        end = self._since()
        if end is None:
            return None
        return self._others(end)

    def _others(self, end) -> float:
        busy = (end[0][0] - self._start[0][0]) * self._tick
        return max(0.0, busy - (end[1] - self._start[1])) / (end[2] - self._start[2])

    def note_or(self, fallback: str | None, remedy: str) -> str | None:
        """:meth:`note` where the run could be measured, else ``fallback`` (the load average's
        note, :func:`writescope.engine.threads.busy_note`, taken before the run)."""
        return self.note(remedy) if self.measurable else fallback

    def note(self, remedy: str) -> str | None:
        """A note when, while the run was timed, other processes took at least half a CPU and a
        quarter of this process's CPUs and those CPUs were nearly saturated (idle under a quarter
        of them), or a CPU quota throttled the process a tenth of the time or more (``remedy``:
        what the command can set); None otherwise or where it cannot be measured."""
        end = self._since()
        if end is None:
            return None
        wall, n = end[2] - self._start[2], len(self.cpus)
        notes = []
        taken = self._others(end)
        idle = (end[0][1] - self._start[0][1]) * self._tick / wall
        if taken >= max(0.5, 0.25 * n) and idle < 0.25 * n:
            notes.append(f"other processes kept {taken:.1f} of the {n} CPUs this process may use busy while it was timed")
        if self._start[3] is not None and end[3] is not None and end[3] - self._start[3] >= 0.1 * wall:
            notes.append(f"the container's CPU quota throttled this process {end[3] - self._start[3]:.1f} s of the {wall:.1f} s timed")
        if not notes:
            return None
        return f"note: {'; '.join(notes)}: these timings suffer (torch's threads most: {remedy} may help)"
