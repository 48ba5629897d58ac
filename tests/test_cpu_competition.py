"""Other processes' CPU use while a run is timed (writescope/engine/cpu_competition.py), from
fake /proc/stat texts, clocks and quotas: no assertion here depends on this machine's load."""

from __future__ import annotations

import pytest

from writescope.engine.cpu_competition import CpuCompetition, cpu_ticks
from writescope.engine.threads import parse_cpu_list

# cpu user nice system idle iowait irq softirq steal guest guest_nice
STAT_A = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 100 0 50 1000 5 0 0 0 0 0
cpu1 200 0 50 1000 5 0 0 0 0 0
cpu2 600 0 200 3000 0 0 0 0 0 0
intr 12345
"""


def _stat(cpu0: int, cpu1: int, cpu2: int = 0, idle: int = 0) -> str:
    """A /proc/stat whose cpu0 / cpu1 / cpu2 have ``cpuN`` busy ticks (user, and on cpu1 a little
    irq, softirq and steal) and ``idle`` idle ticks each (iowait too, not busy, on cpu0)."""
    return (f"cpu  {cpu0 + cpu1 + cpu2} 0 0 0 0 0 0 0 0 0\n"
            f"cpu0 {cpu0} 0 0 {idle} 0 0 0 0 0 0\n"
            f"cpu1 {cpu1 - 6} 0 0 {idle} 0 1 2 3 0 0\n"
            f"cpu2 {cpu2} 0 0 {idle} 0 0 0 0 0 0\n")


def test_cpu_ticks_counts_the_given_cpus_busy_and_idle_columns():
    assert cpu_ticks(STAT_A, {0, 1}) == (150 + 250, 2000 + 10)  # iowait counts as idle, not busy
    assert cpu_ticks(STAT_A, {2}) == (800, 3000)
    assert cpu_ticks(STAT_A, {7}) is None and cpu_ticks(STAT_A, {1, 7}) is None  # every CPU must be named
    assert cpu_ticks("cpu0 1 2 3 4 5 6 7 8\n", {0}) == (1 + 2 + 3 + 6 + 7 + 8, 4 + 5)  # irq, softirq, steal busy
    assert cpu_ticks("cpu0 4 0 1\n", {0}) == (5, 0)  # short lines (old kernels) read as zeros beyond
    assert cpu_ticks("cpu0 4 x 1\n", {0}) is None  # unreadable: not measured, no crash


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    with pytest.raises(ValueError):
        parse_cpu_list("a-b")


class _Fake:
    def __init__(self):
        self.stat, self.own, self.now, self.throttled = _stat(0, 0), 0.0, 0.0, None


def _meter(f: _Fake, cpus=frozenset({0, 1})) -> CpuCompetition:
    return CpuCompetition(read_stat=lambda: f.stat, own_seconds=lambda: f.own, clock=lambda: f.now, cpus=set(cpus), tick=0.01,
                          throttled=lambda: f.throttled)


def test_a_quiet_run_gives_no_note_and_a_busy_one_names_what_others_took():
    f = _Fake()
    m = _meter(f)
    # 10 s: this process used 15 CPU-seconds (1,500 ticks) and the two CPUs were busy 1,520 ticks
    f.stat, f.own, f.now = _stat(760, 760), 15.0, 10.0
    assert m.others() == pytest.approx(0.02)
    assert m.note("OMP_WAIT_POLICY=passive") is None
    # later: others took 1.2 CPUs on average over the 20 s since the start, the CPUs saturated
    f.stat, f.own, f.now = _stat(2720, 2720), 30.0, 20.0
    assert m.others() == pytest.approx((5440 * 0.01 - 30.0) / 20.0)
    note = m.note("OMP_WAIT_POLICY=passive")
    assert note is not None and "kept 1.2 of the 2 CPUs this process may use busy" in note and "OMP_WAIT_POLICY=passive" in note
    # load on a CPU this process may not run on is no competition
    f2 = _Fake()
    m2 = _meter(f2)
    f2.stat, f2.own, f2.now = _stat(500, 500, 9000), 10.0, 10.0
    assert m2.others() == pytest.approx(0.0) and m2.note("x") is None


def test_others_on_cpus_that_stood_idle_anyway_are_no_competition():
    f = _Fake()
    m = _meter(f, cpus=frozenset({0, 1, 2}))
    f.stat, f.now = _stat(100, 100, 0, idle=100), 1.0  # others took 2 CPUs, the third idle all along
    assert m.others() == pytest.approx(2.0) and m.note("x") is None
    f.stat = _stat(100, 100, 100, idle=10)  # all three nearly saturated
    assert m.note("x") is not None


def test_the_threshold_is_half_a_cpu_and_a_quarter_of_the_cpus():
    f = _Fake()
    m = _meter(f)
    f.stat, f.now = _stat(24, 24), 1.0  # 0.48 CPUs taken by others: below half a CPU
    assert m.note("x") is None
    f.stat = _stat(26, 26)  # 0.52
    assert m.note("x") is not None
    f16 = _Fake()
    f16.stat = "".join(f"cpu{i} 0 0 0 9 0 0 0 0\n" for i in range(16))
    m16 = _meter(f16, cpus=frozenset(range(16)))
    f16.stat, f16.now = "".join(f"cpu{i} {30 if i < 10 else 0} 0 0 9 0 0 0 0\n" for i in range(16)), 1.0
    assert m16.others() == pytest.approx(3.0) and m16.note("x") is None  # 3 of 16: under a quarter
    f16.stat = "".join(f"cpu{i} {50 if i < 10 else 0} 0 0 9 0 0 0 0\n" for i in range(16))
    assert m16.note("x") is not None  # 5 of 16


def test_short_runs_and_unreadable_stat_are_not_measured():
    f = _Fake()
    m = _meter(f)
    assert m.min_wall == pytest.approx(0.32)  # two CPUs, 10 ms ticks
    f.stat, f.now = _stat(30, 30), 0.3  # busy, but under 0.32 s: a tick's error would be much of the figure
    assert m.others() is None and m.note("x") is None
    f.now = 0.4  # a short run, measured (a tiny preset's generate: under a second)
    assert m.others() == pytest.approx(1.5) and m.note("x") is not None
    m = CpuCompetition(read_stat=lambda: None, own_seconds=lambda: 0.0, clock=lambda: 0.0, cpus={0}, tick=0.01,
                       throttled=lambda: None)
    assert not m.measurable and m.others() is None and m.note("x") is None
    assert m.note_or("note: the load average ...", "x") == "note: the load average ..."
    f = _Fake()
    measured = _meter(f)
    f.now = 1.0
    assert measured.measurable and measured.note_or("note: the load average ...", "x") is None  # measured quiet: no note


def test_a_cpu_quota_that_throttled_the_run_is_named():
    f = _Fake()
    f.throttled = 5.0
    m = _meter(f)
    f.stat, f.own, f.now, f.throttled = _stat(100, 100), 2.0, 10.0, 5.5  # 0.5 s of 10: under a tenth
    assert m.note("x") is None
    f.throttled = 7.0
    note = m.note("x")
    assert note is not None and "CPU quota throttled this process 2.0 s of the 10.0 s timed" in note


def test_this_machine_can_be_read_without_a_crash():
    """The real readers (/proc/stat, the threads' allowed CPUs, the clock tick, a cgroup quota)
    with a clock said to have advanced 2 s (no waiting, nothing timed): a figure at least 0, a note
    or none."""
    now = [0.0]
    m = CpuCompetition(clock=lambda: now[0])
    if not m.measurable:
        pytest.skip("no /proc/stat naming this process's CPUs here")
    now[0] = 2.0
    taken = m.others()
    assert taken is not None and taken >= 0.0
    note = m.note("x")
    assert note is None or note.startswith("note: ")


def test_the_usable_cpus_are_every_thread_s_not_the_calling_thread_s_alone():
    """OpenMP under OMP_PROC_BIND binds the calling thread alone to one CPU: the process may still
    use every CPU its threads may run on, so the thread counts and the competition meter read the
    union of the threads' allowed lists, not the caller's mask."""
    import os
    import threading

    from writescope.engine.threads import process_cpus, usable_cpus

    every = process_cpus()
    if not hasattr(os, "sched_setaffinity") or len(every) < 2:
        pytest.skip("needs a settable affinity and two CPUs")
    seen = {}

    def bound():  # a thread bound to one CPU, as OMP_PROC_BIND binds the calling thread
        os.sched_setaffinity(0, {min(every)})
        seen["own"] = os.sched_getaffinity(0)
        seen["cpus"], seen["count"] = process_cpus(), usable_cpus()
        seen["meter"] = CpuCompetition(clock=lambda: 0.0).cpus

    t = threading.Thread(target=bound)
    t.start()
    t.join()
    assert seen["own"] == {min(every)}  # the old reading: one CPU
    assert seen["cpus"] == every and seen["count"] == len(every)
    assert seen["meter"] == every


def test_a_cpu_quota_is_read_from_cgroup_v2_or_v1(tmp_path):
    """cgroup v2: cpu.max and cpu.stat's throttled_usec; v1: cpu/cpu.cfs_quota_us and cpu/cpu.stat's
    throttled_time (ns); no quota (v2 "max", v1 -1, or no files): None."""
    from writescope.engine.cpu_competition import _throttled_s

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("200000 100000\n")
    (v2 / "cpu.stat").write_text("usage_usec 9\nnr_throttled 3\nthrottled_usec 2500000\n")
    assert _throttled_s(str(v2)) == pytest.approx(2.5)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert _throttled_s(str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu,cpuacct" / "cpu.stat").write_text("nr_periods 10\nnr_throttled 2\nthrottled_time 1500000000\n")
    assert _throttled_s(str(v1)) == pytest.approx(1.5)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    assert _throttled_s(str(v1)) is None
    assert _throttled_s(str(tmp_path / "none")) is None


def test_the_shortest_run_measured_keeps_the_tick_error_under_a_quarter_of_the_threshold():
    from writescope.engine.cpu_competition import min_wall_s

    for n in (1, 2, 3, 16, 128):
        wall = min_wall_s(n, 0.01)
        assert 2 * n * 0.01 / wall == pytest.approx(max(0.5, 0.25 * n) / 4)  # the error at that wall, in CPUs
    assert min_wall_s(16, 0.01) == pytest.approx(0.32) and min_wall_s(1, 0.01) == pytest.approx(0.16)
