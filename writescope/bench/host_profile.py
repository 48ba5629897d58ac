"""Where the thread that issues a decode step spends its time: Python's own profiler (cProfile) on
the main thread over a few decode steps.

A split decode step is bound by this thread when it cannot stay ahead of the device (the
``main thread ahead`` column of :mod:`writescope.bench.timeline`): every torch call, Triton launch,
event and Python loop of a layer costs host time before the device sees the work. cProfile counts
each function's own time (``tottime``: inside it, not in what it calls; torch's and Triton's C
entry points appear as builtins, e.g. ``<method 'copy_' of 'torch._C.TensorBase' objects>``) and
its cumulative time (``cumtime``), per call. It slows pure-Python code by about 1.5-2x, so read the
shares and the call counts, not the absolute milliseconds; the step's wall time under the profiler
is reported next to them.

Only the decode steps after ``skip`` warm-up steps are profiled. The native CPU worker is C++ and
never appears; with ``WRITESCOPE_CPU_WORKER=python`` the thread pool's thread does on Python 3.12
and later, whose cProfile (built on ``sys.monitoring``) sees every thread, merged into the same
listing (3.11's sees the thread that enabled it only); the garbage collections counted are the
process's. The synchronisation after each step (taken to separate the steps) is left out. In the
H200 runs (Python 3.12) the listing had no entry for a pybind11 method's call, whose time then
counts as its caller's own, so the native worker's submit is also timed around its call
(``submit_total_ms``, ``submit_wall_ms``).
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import statistics
import time
from dataclasses import dataclass, field

from writescope.bench.profiled_steps import check_steps, run_decode_steps
from writescope.engine.timing import synchronize


@dataclass(frozen=True)
class FunctionTime:
    """One function's totals per profiled decode step: ``calls``, ``own_ms`` (cProfile's
    tottime), ``cum_ms`` (cumtime)."""

    name: str  # file:line(function), or a builtin's name
    calls: float
    own_ms: float
    cum_ms: float


@dataclass
class HostProfile:
    """:func:`main_thread_profile`'s result."""

    step_ms: float  # median wall time of a profiled step (profiler overhead included)
    steps: int
    layer_calls: float  # decode attention calls per step (layers, times micro-batches)
    thread_cpu_ms: float = float("nan")  # median CPU time of the main thread in a step (its wall time less time off a CPU)
    submit_wall_ms: float = float("nan")  # per step: the native worker's native submit calls, wall time on the main thread
    submit_total_ms: float = float("nan")  # per step: the worker's submit method in all, timed without cProfile's attribution
    gc_ms: dict = field(default_factory=dict)  # per step: Python's garbage collections by generation, (collections, ms)
    functions: list[FunctionTime] = field(default_factory=list)  # by own time, largest first
    text: str = ""  # pstats' full listing, by own time
    step_mean_ms: float = float("nan")  # mean wall time of a profiled step: the per-step figures above are means over the steps

    def table(self, top: int = 25) -> str:
        """The ``top`` functions by own time, and the ``top`` of WriteScope's own by cumulative time."""
        per = max(self.layer_calls, 1.0)
        head = (f"main thread under cProfile: decode step {self.step_ms:.2f} ms (median of {self.steps}), the thread on a CPU "
                f"{self.thread_cpu_ms:.2f} ms of it, {self.layer_calls:.0f} decode attention calls a step; ms and calls per step, "
                f"and per call of the attention")
        if self.submit_wall_ms == self.submit_wall_ms:  # not nan: the native worker took jobs
            head += f"\nnative worker's submit: {self.submit_total_ms:.3f} ms a step in all, its native call {self.submit_wall_ms:.3f} ms"
        gcs = ", ".join(f"generation {g}: {n:.1f} taking {ms:.2f} ms" for g, (n, ms) in sorted(self.gc_ms.items())) or "none"
        head += f"\nPython's garbage collections a step (in whichever function allocated): {gcs}"
        cols = f"{'own ms':>9s} {'cum ms':>9s} {'calls':>9s} {'calls/attn':>10s}  function"
        row = lambda f: f"{f.own_ms:9.3f} {f.cum_ms:9.3f} {f.calls:9.0f} {f.calls / per:10.1f}  {f.name}"  # noqa: E731
        ours = sorted((f for f in self.functions if "writescope" in f.name), key=lambda f: -f.cum_ms)[:top]
        return "\n".join([head, "by own time:", cols, *map(row, self.functions[:top]),
                          "WriteScope's functions by cumulative time:", cols, *map(row, ours)])

    def to_json(self, top: int = 60) -> dict:
        return {"step_ms": self.step_ms, "step_mean_ms": self.step_mean_ms, "steps": self.steps, "layer_calls": self.layer_calls, "thread_cpu_ms": self.thread_cpu_ms,
                "submit_wall_ms": self.submit_wall_ms, "submit_total_ms": self.submit_total_ms,
                "gc_ms": {str(g): v for g, v in self.gc_ms.items()},
                "functions": [vars(f) for f in self.functions[:top]]}


def _name(key: tuple) -> str:
    path, line, func = key
    if path == "~":  # a builtin: func is e.g. "<method 'copy_' of 'torch._C.TensorBase' objects>"
        return func
    parts = path.replace("\\", "/").split("/")
    if "writescope" in parts:  # from the package root down
        path = "/".join(parts[parts.index("writescope"):])
    elif "site-packages" in parts:
        path = "/".join(parts[parts.index("site-packages") + 1:])
    return f"{path}:{line}({func})"


def main_thread_profile(llm, prompt_token_ids: list[list[int]], steps: int = 3, skip: int = 2) -> HostProfile:
    """Generate with the prompts and profile the main thread (cProfile) over ``steps`` decode
    steps after ``skip`` others (see the module doc).

    Args:
        llm: a loaded :class:`~writescope.engine.llm.LLM` (its current policy is used).
        prompt_token_ids: the batch's prompts.
        steps, skip: decode steps profiled (>= 1), and decode steps run first (>= 0).

    Raises:
        ValueError: steps < 1 or skip < 0; and whatever ``generate`` raises for the prompts.
    """
    check_steps(steps, skip)
    prof = cProfile.Profile()
    hooks = [0]  # decode steps finished (the first one holds the prefill)
    stamps: list[float] = []
    cpu: list[float] = []  # the main thread's CPU time at each stamp
    submits: list[tuple[int, int]] = []  # the native worker's submit ns so far (its native call, in all), at each stamp
    decoder = getattr(llm.cache, "decoder", None)
    calls = [0]
    profiling = lambda: bool(stamps) and len(stamps) <= steps  # noqa: E731 - between the first and the last stamp

    def on_attention():
        if profiling():
            calls[0] += 1

    def on_step():
        prof.disable()  # the synchronisation that separates the steps is not the step's
        synchronize(llm.device)
        hooks[0] += 1
        if hooks[0] >= 1 + skip and len(stamps) <= steps:
            stamps.append(time.perf_counter())
            cpu.append(time.thread_time())
            w = getattr(decoder, "worker", None)
            submits.append((w.submit_wall_ns, w.submit_total_ns) if w is not None else (0, 0))
            if len(stamps) <= steps:
                prof.enable()

    collected: dict[int, list[float]] = {}  # generation -> [collections, seconds] while profiling
    gc_start = [0.0]

    def on_gc(phase, info):
        if not profiling():
            return
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            c = collected.setdefault(info["generation"], [0, 0.0])
            c[0] += 1
            c[1] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)
    try:
        run_decode_steps(llm, prompt_token_ids, steps, skip, on_step, on_attention=on_attention)
    finally:
        prof.disable()
        gc.callbacks.remove(on_gc)
    done = len(stamps) - 1
    if done < 1:
        return HostProfile(float("nan"), 0, 0.0)
    walls = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    thread_cpu_ms = statistics.median(b - a for a, b in zip(cpu, cpu[1:])) * 1e3
    submit_wall, submit_total = ((submits[-1][k] - submits[0][k]) / 1e6 / done for k in (0, 1))
    if submits[-1] == submits[0]:  # no native job in the profiled steps
        submit_wall = submit_total = float("nan")
    st = pstats.Stats(prof)
    funcs = [FunctionTime(_name(key), nc / done, tt * 1e3 / done, ct * 1e3 / done)
             for key, (_, nc, tt, ct, _) in st.stats.items()]  # type: ignore[attr-defined]
    funcs.sort(key=lambda f: -f.own_ms)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats()
    gcs = {g: (n / done, secs * 1e3 / done) for g, (n, secs) in collected.items()}
    return HostProfile(statistics.median(walls), done, calls[0] / done, thread_cpu_ms, submit_wall, submit_total, gcs, funcs, buf.getvalue(),
                       step_mean_ms=statistics.fmean(walls))
