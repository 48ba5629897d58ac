"""One CPU team for the native workers of a decode step (issue 14 item 4; docs/DESIGN.md section 10).

The CPU attention worker (attention/cpu_worker.py) and the host-expert worker
(moe/expert_worker.py) each ran their jobs on a thread of their own, and so on an OpenMP team of
their own: on the H200 host two teams of 15 threads on 16 cores, the idle worker's thread spinning
on its next job's ready flag while the other's team ran (Mixtral 4 x 32000, run 47: CPU attention
83 ns per token beside the expert worker, 58 without it). Their jobs never overlap in time anyway:
layer l's experts need layer l's attention, and layer l + 1's attention needs layer l's experts.

A :class:`CpuTeam` is one native ``Executor`` (native/flag_worker.h): one thread that runs the jobs
of every worker made with it in the order they were submitted, which is the order the device's
stream hands their inputs over (each job's ready flag is set on the stream right after its submit),
so no job waits behind one whose inputs come later. Its OpenMP team is that thread's: one set of
threads for both kinds of job.

``WRITESCOPE_CPU_TEAM``: ``one`` (the default: the engine's workers share :func:`engine_team`) or
``own`` (each worker its own thread and team, as before, for comparison).
"""

from __future__ import annotations

import threading
import weakref

from writescope.env import env_choice

ENV = "WRITESCOPE_CPU_TEAM"


def team_wanted() -> bool:
    """Whether the engine's native workers share one thread and team (``WRITESCOPE_CPU_TEAM``).

    Raises:
        ValueError: a value other than ``one`` or ``own`` (names it).
    """
    return env_choice(ENV, ("one", "own")) == "one"


class CpuTeam:
    """One executor thread (and so one OpenMP team) for the native workers given it.

    Args:
        ext: a native extension that binds ``Executor`` (writescope.native.flag_worker.h's
            ``bind_flag_worker`` does, in the attention and the expert extension).
        cpus: the CPUs the thread and its team may run on (None: wherever the process may).

    A worker made with the team holds it, so the thread outlives every worker that posts to it;
    it stops when the last holder is gone (or at :meth:`close`, after which workers made with it
    refuse new jobs).
    """

    def __init__(self, ext, cpus: list[int] | None = None):
        self.cpus = [int(c) for c in cpus] if cpus else []
        self.closed = False
        self._x = ext.Executor(self.cpus)

    @property
    def address(self) -> int:
        """The native executor's address (what a worker's constructor takes, with :attr:`post_address`)."""
        return int(self._x.address)

    @property
    def post_address(self) -> int:
        """The address of the function that queues a task on it, of the module that made it."""
        return int(self._x.post_address)

    @property
    def pinned(self) -> bool:
        """The thread runs on the CPUs asked for (False until it has started, where none were asked
        for, or where the OS refused)."""
        return bool(self._x.pinned)

    @property
    def tasks_run(self) -> int:
        """Jobs run on the thread since it started, of all its workers."""
        return int(self._x.tasks_run)

    def close(self) -> None:
        """Run what is queued (a job still waiting for its inputs gives up) and stop the thread;
        later jobs of its workers are refused."""
        self.closed = True
        self._x.close()


_lock = threading.Lock()
_team: weakref.ref | None = None


def engine_team(ext, cpus: list[int] | None = None) -> CpuTeam | None:
    """The team the engine's workers share, or None under ``WRITESCOPE_CPU_TEAM=own`` (or with no
    ``ext``, where the native kernel was not built): the live
    one (held by a worker, not closed) on ``cpus`` (the CPU attention worker's under
    ``WRITESCOPE_CPU_PIN=on``, ``worker_cpus``; both workers ask with them), else a new one made
    with ``ext``'s executor, which later calls then get.

    Raises:
        ValueError: a bad ``WRITESCOPE_CPU_TEAM``.
    """
    global _team
    if ext is None or not team_wanted():  # no extension: the worker's own constructor says why
        return None
    with _lock:
        team = _team() if _team is not None else None
        if team is None or team.closed or team.cpus != ([int(c) for c in cpus] if cpus else []):
            team = CpuTeam(ext, cpus)
            _team = weakref.ref(team)
        return team
