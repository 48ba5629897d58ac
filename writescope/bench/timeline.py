"""A decode step's timeline across the CPU worker, the compute stream and the link.

Where a split step's time goes is a question of order, not of sums: the CPU attends layer l only
once the GPU has made layer l's q, the GPU merges layer l only once the CPU is done, and the link
streams the next layer's blocks meanwhile. This module lays the three side by side for the decode
steps of ``writescope profile --timeline`` (:func:`decode_timeline`):

- the CPU worker's jobs (one per layer, or per half with micro-batches): when the worker took the
  job, saw its q (the ready flag) and set its done flag (:meth:`NativeWorker.take_trace
  <writescope.attention.cpu_worker.NativeWorker.take_trace>`, CLOCK_MONOTONIC); and the native
  expert worker's (moe/async_experts.py: the CPU's share of a layer's host experts), ``kind``
  ``"experts"``, recorded the same way;
- the device's activity from torch's profiler (CUPTI only): on the compute stream, the one-CTA flag
  kernels (``_store``: q is in host memory, the ready flag set; ``_wait``: the stream spinning on
  the done flag, i.e. the GPU waiting for the CPU) and every other kernel; the host-to-device
  copies (the load region's ping-pong fills, on the copy stream: the link).

The profiler records the device only (CUPTI; recording every torch call on the main thread as well
would slow the thread that issues the step, and with it the step: two micro-batches ran 269 ms
per step under the full profiler against 196-227 ms in bench rows on the H200). The host's times
(the step boundaries, the main thread entering each decode call's attention, the worker's jobs) are
``time.perf_counter_ns`` (CLOCK_MONOTONIC); the device's clock is placed on it by the flag kernels
(:func:`flag_offset`): a job's q is seen after its ``_store`` ended, and a ``_wait`` that was
waiting ends after its job's done flag, which bounds the offset from both sides. Each CPU job is
paired with the k-th ``_store`` and ``_wait`` of its step (one of each per job, in submission
order; both workers' flags run on the compute stream in stream order, a layer's attention job
before its experts' job, so the jobs of both kinds are paired in the order they saw their inputs). All times below are on the host's clock. The flags bound the offset by the two hand-off
latencies, so ``q_to_cpu_ms`` and ``done_to_gpu_ms`` are split between themselves only within the
alignment's uncertainty (printed); their sum is measured. Per job:

| figure | from | what it is |
|---|---|---|
| ``cpu_ms`` | seen -> done | the CPU attention |
| ``q_to_cpu_ms`` | ``_store`` end -> seen | the worker noticing its q (0 when the worker was still busy with the last job: then it counts in ``cpu_ms`` of that job) |
| ``done_to_gpu_ms`` | done -> ``_wait`` end | the device noticing the done flag (only where it was waiting) |
| ``gpu_wait_ms`` | ``_wait`` start -> end | the compute stream idle, waiting for the CPU |
| ``cpu_idle_ms`` | done -> next job's seen | the CPU side idle before its next job (of either worker): the hand-back, the merge, the layer's other work (O), the next inputs |
| ``issue_lead_ms`` | the main thread enters the layer's attention (``attend_begin``) -> ``_store`` start | how far the main thread ran ahead of the device; near 0: the device waited for Python (issue-bound); attention jobs only |

The step's ``link_busy`` is the union of its host-to-device copies over the step (kernels reading
pinned memory in place, such as ``WRITESCOPE_LOAD_READ=in-place`` or host experts read over PCIe,
use the link too but are kernels, not copies: they count in ``gpu_busy``); ``cpu_busy`` the sum of
its jobs (``cpu_attention`` and ``cpu_experts`` by kind); ``gpu_busy`` the union of the device's kernels on every stream other than the flag kernels.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from writescope.bench.profiled_steps import check_steps, run_decode_steps
from writescope.engine.timing import synchronize

STORE, WAIT = "_store", "_wait"  # the flag kernels' names (attention/flag_kernels.py)


@dataclass
class DeviceEvent:
    """One device activity: ``name``, ``stream`` (CUPTI's stream id), start and end in ns of the
    profiler's clock."""

    name: str
    stream: int
    start: int
    end: int


@dataclass
class Job:
    """One CPU worker job in ns of the profiler's clock (see the module doc): ``kind``
    ``"attention"`` (the CPU attention worker) or ``"experts"`` (the native expert worker)."""

    taken: int
    seen: int
    done: int
    kind: str = "attention"


@dataclass
class StepTimeline:
    """One decode step: its span (ns of the profiler's clock) and what ran in it (see the module doc)."""

    start: int
    end: int
    jobs: list[Job] = field(default_factory=list)
    stores: list[DeviceEvent] = field(default_factory=list)
    waits: list[DeviceEvent] = field(default_factory=list)
    kernels: list[DeviceEvent] = field(default_factory=list)  # every stream's, flag kernels excluded
    copies: list[DeviceEvent] = field(default_factory=list)  # host-to-device
    issues: list[int] = field(default_factory=list)  # the main thread entering each decode call's attention

    @property
    def ms(self) -> float:
        return (self.end - self.start) / 1e6

    def per_job(self) -> list[dict]:
        """Per CPU job, the figures of the module doc in ms (a figure is None where its pairing is
        missing: a job without its ``_store`` or ``_wait`` in this step)."""
        paired = len(self.stores) == len(self.jobs) == len(self.waits)
        attention = [i for i, j in enumerate(self.jobs) if j.kind == "attention"]
        lead = dict(zip(attention, self.issues)) if paired and len(self.issues) == len(attention) else {}
        rows = []
        for i, j in enumerate(self.jobs):
            row = {"kind": j.kind, "cpu_ms": (j.done - j.seen) / 1e6, "q_to_cpu_ms": None, "done_to_gpu_ms": None, "gpu_wait_ms": None,
                   "cpu_idle_ms": (self.jobs[i + 1].seen - j.done) / 1e6 if i + 1 < len(self.jobs) else None,
                   "issue_lead_ms": None}
            if i in lead:
                row["issue_lead_ms"] = (self.stores[i].start - lead[i]) / 1e6
            if paired:
                st, wt = self.stores[i], self.waits[i]
                ready = max(st.end, self.jobs[i - 1].done if i else st.end)  # a busy worker sees q when it is done with the last job
                row["q_to_cpu_ms"] = max(0.0, (j.seen - ready) / 1e6)
                row["gpu_wait_ms"] = (wt.end - wt.start) / 1e6
                row["done_to_gpu_ms"] = (wt.end - j.done) / 1e6 if wt.start <= j.done else 0.0
            rows.append(row)
        return rows

    def summary(self) -> dict:
        """The step in ms: its length, the CPU's, the GPU's and the link's busy time, the GPU's
        waits for the CPU, and the medians of the per-job figures."""
        busy = {k: sum(j.done - j.seen for j in self.jobs if j.kind == k) / 1e6 for k in ("attention", "experts")}
        out = {"step_ms": self.ms, "jobs": len(self.jobs), "cpu_busy_ms": sum(j.done - j.seen for j in self.jobs) / 1e6,
               "expert_jobs": sum(j.kind == "experts" for j in self.jobs),
               "cpu_attention_ms": busy["attention"], "cpu_experts_ms": busy["experts"],
               "gpu_busy_ms": _union(self.kernels, self.start, self.end) / 1e6,
               "gpu_wait_ms": sum(w.end - w.start for w in self.waits) / 1e6,
               "link_busy_ms": _union(self.copies, self.start, self.end) / 1e6}
        rows = self.per_job()
        for k in ("cpu_ms", "q_to_cpu_ms", "done_to_gpu_ms", "gpu_wait_ms", "cpu_idle_ms", "issue_lead_ms"):
            xs = [r[k] for r in rows if r[k] is not None and (k != "cpu_ms" or r["kind"] == "attention")]
            out[f"median_{k}"] = statistics.median(xs) if xs else None
        xs = [r["cpu_ms"] for r in rows if r["kind"] == "experts"]
        out["median_expert_ms"] = statistics.median(xs) if xs else None
        return out


def _union(events: list[DeviceEvent], lo: int, hi: int) -> int:
    """ns covered by the events' intervals clipped to [lo, hi] (overlaps counted once)."""
    spans = sorted((max(e.start, lo), min(e.end, hi)) for e in events if e.end > lo and e.start < hi)
    total, cur_a, cur_b = 0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def flag_offset(device: list[DeviceEvent], jobs: list[Job]) -> tuple[int, int] | None:
    """``(offset, uncertainty)`` in ns to subtract from the device's times to put them on the
    host's clock, from the flag kernels (module doc): a job's ``seen`` comes after its ``_store``'s
    end, so offset >= store.end - seen for every job; the device sees a done flag after it was set,
    so offset <= wait.end - done for every ``_wait`` that started before its job was done. The
    midpoint of the two bounds, and half their gap (their disagreement, when the lower bound is the
    larger, as its absolute value). None without a paired ``_store``."""
    stores = sorted((e for e in device if e.name == STORE), key=lambda e: e.start)
    waits = sorted((e for e in device if e.name == WAIT), key=lambda e: e.start)
    jobs = sorted(jobs, key=lambda j: j.seen)
    n = min(len(stores), len(jobs))
    if n == 0:
        return None
    # pair from the end: the trace and the profiler may start at different jobs, not end at different ones
    lo = max(st.end - j.seen for st, j in zip(stores[-n:], jobs[-n:]))
    m = min(len(waits), len(jobs))
    his = [w.end - j.done for w, j in zip(waits[-m:], jobs[-m:]) if w.start - lo < j.done] if m else []
    if not his:
        return lo, 0
    hi = min(his)
    return (lo + hi) // 2, abs(hi - lo) // 2


def sync_offset(device: list[DeviceEvent], last_stamp: int) -> int | None:
    """The offset of :func:`flag_offset` from the last profiled step's end alone, coarser (by the
    host's wake-up after a synchronisation, tens of microseconds): that step ends with a
    synchronisation, so the device's last activity ends just before the host's ``last_stamp``.
    None without device events."""
    return max(e.end for e in device) - last_stamp if device else None


def device_events(events) -> list[DeviceEvent]:
    """The device's kernels and copies among kineto ``events`` (the profiler's user-annotation
    ranges shown on the device left out)."""
    from torch.autograd import DeviceType

    out = []
    for e in events:
        if e.device_type() != DeviceType.CUDA or getattr(e, "is_user_annotation", lambda: False)():
            continue
        out.append(DeviceEvent(e.name(), int(e.device_resource_id()), int(e.start_ns()), int(e.end_ns())))
    return out


def host_starts(events, name: str) -> list[int]:
    """Start times (ns) of the host-side ranges called ``name`` among kineto ``events``."""
    from torch.autograd import DeviceType

    return sorted(int(e.start_ns()) for e in events if e.name() == name and e.device_type() == DeviceType.CPU)


def build_steps(bounds: list[tuple[int, int]], device: list[DeviceEvent], jobs: list[Job], issues: list[int] = ()) -> list[StepTimeline]:
    """Sort ``device`` events, CPU ``jobs`` and the main thread's ``issues`` (ns) into the steps whose
    ``(start, end)`` ``bounds`` (ns, the profiler's clock) hold them (by start time; a job by the
    time it saw its q). The compute stream is the one that ran ``_wait`` kernels (or, without any,
    the one with the most kernels)."""
    kernels = [e for e in device if not e.name.startswith("Memcpy") and not e.name.startswith("Memset")]
    waits = [e for e in kernels if e.name == WAIT]
    counts: dict[int, int] = {}
    for e in (waits or kernels):
        counts[e.stream] = counts.get(e.stream, 0) + 1
    compute = max(counts, key=counts.get) if counts else None
    steps = []
    for lo, hi in bounds:
        inside = lambda t: lo <= t < hi  # noqa: E731
        st = StepTimeline(lo, hi)
        st.jobs = [j for j in jobs if inside(j.seen)]
        st.issues = sorted(t for t in issues if inside(t))
        for e in device:
            if not inside(e.start):
                continue
            if e.name.startswith("Memcpy HtoD"):
                st.copies.append(e)
            elif e.name.startswith("Memcpy") or e.name.startswith("Memset"):
                continue
            elif e.name in (STORE, WAIT):
                if e.stream == compute:
                    (st.stores if e.name == STORE else st.waits).append(e)
            else:  # any stream's: the load partials may run on a stream of their own (WRITESCOPE_LOAD_STREAM=own)
                st.kernels.append(e)
        st.jobs.sort(key=lambda j: j.seen)
        for xs in (st.stores, st.waits, st.kernels, st.copies):
            xs.sort(key=lambda e: e.start)
        steps.append(st)
    return steps


def format_summary(timeline: Timeline) -> str:
    """Medians over the steps of :meth:`StepTimeline.summary`, as text."""
    steps = timeline.steps
    if not steps:
        return "timeline: no decode step laid out"
    sums = [s.summary() for s in steps]

    def med(k):
        xs = [x[k] for x in sums if x[k] is not None]
        return statistics.median(xs) if xs else float("nan")

    step = med("step_ms")
    how = {"flags": f"the device's clock placed by the flag kernels, within {(timeline.uncertainty_ns or 0) / 1e3:.0f} us",
           "sync": "the device's clock placed by the last synchronisation (tens of us)", "host": "no device"}[timeline.aligned_by]
    lines = [f"timeline of {len(steps)} decode step(s) (medians; ms per step, and per CPU job; {how}):",
             f"  step {step:.2f} ms: CPU worker busy {med('cpu_busy_ms'):.2f} ({100 * med('cpu_busy_ms') / step:.0f}%) in "
             f"{med('jobs'):.0f} jobs; link (host-to-device copies) busy {med('link_busy_ms'):.2f} ({100 * med('link_busy_ms') / step:.0f}%); "
             f"device kernels busy {med('gpu_busy_ms'):.2f} ({100 * med('gpu_busy_ms') / step:.0f}%) and waiting for the CPU "
             f"{med('gpu_wait_ms'):.2f} ({100 * med('gpu_wait_ms') / step:.0f}%)"]
    device = any(s.kernels or s.copies or s.waits or s.stores for s in steps)
    if not device:  # CPU tensors stand in for the device (no CUDA): only the worker's side is timed
        lines[1] = f"  step {step:.2f} ms: CPU worker busy {med('cpu_busy_ms'):.2f} ({100 * med('cpu_busy_ms') / step:.0f}%) in {med('jobs'):.0f} jobs (no device)"
    if med("expert_jobs") > 0:
        lines[1] += (f"; of the CPU's busy time, attention {med('cpu_attention_ms'):.2f} and host experts {med('cpu_experts_ms'):.2f}"
                     f" ({med('expert_jobs'):.0f} expert jobs, {med('median_expert_ms'):.3f} each)")
    if med("jobs") > 0:
        line = f"  per CPU job: attention {med('median_cpu_ms'):.3f}; idle before the next {med('median_cpu_idle_ms'):.3f}"
        if device:
            line += (f" (hand-back, merge, the layer's other work, the next q); q flag -> worker {med('median_q_to_cpu_ms'):.3f}; "
                     f"done flag -> device {med('median_done_to_gpu_ms'):.3f}; device waiting {med('median_gpu_wait_ms'):.3f}; "
                     f"main thread ahead of the device by {med('median_issue_lead_ms'):.3f}")
        lines.append(line)
    return "\n".join(lines)


def to_json(timeline: Timeline) -> dict:
    """The steps' summaries and per-job rows, and the first step's intervals (ms from its start;
    ``job_kinds`` beside ``jobs``)."""
    steps = timeline.steps
    out = {"aligned_by": timeline.aligned_by, "uncertainty_ns": timeline.uncertainty_ns,
           "steps": [dict(s.summary(), per_job=s.per_job()) for s in steps]}
    if steps:
        s = steps[0]
        ms = lambda t: (t - s.start) / 1e6  # noqa: E731
        out["first_step"] = {"jobs": [[ms(j.taken), ms(j.seen), ms(j.done)] for j in s.jobs], "job_kinds": [j.kind for j in s.jobs],
                             "issues": [ms(t) for t in s.issues],
                             **{k: [[e.name, ms(e.start), ms(e.end)] for e in getattr(s, k)] for k in ("stores", "waits", "kernels", "copies")}}
    return out


def plot(step: StepTimeline, path: str, title: str = "") -> None:
    """One step as a PNG: rows for the CPU worker's jobs (and the expert worker's, where it ran),
    the compute stream's kernels, its waits for the CPU, and the link's copies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = lambda t: (t - step.start) / 1e6  # noqa: E731
    rows = [
        ("link (H2D copies)", [(ms(e.start), ms(e.end) - ms(e.start)) for e in step.copies], "tab:green"),
        ("GPU waits for CPU", [(ms(e.start), ms(e.end) - ms(e.start)) for e in step.waits], "tab:red"),
        ("GPU kernels (any stream)", [(ms(e.start), ms(e.end) - ms(e.start)) for e in step.kernels], "tab:blue"),
        ("CPU worker", [(ms(j.seen), ms(j.done) - ms(j.seen)) for j in step.jobs if j.kind == "attention"], "tab:orange"),
    ]
    if any(j.kind == "experts" for j in step.jobs):
        rows.append(("CPU expert worker", [(ms(j.seen), ms(j.done) - ms(j.seen)) for j in step.jobs if j.kind == "experts"], "tab:purple"))
    fig, ax = plt.subplots(figsize=(14, 3.6))
    rows.append(("main thread issues", [(ms(t), step.ms / 1500) for t in step.issues], "black"))
    for y, (_, spans, color) in enumerate(rows):
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color)
    for e in step.stores:  # the ready flags: q handed to the CPU
        ax.axvline(ms(e.start), ymin=0.0, ymax=1.0, color="black", linewidth=0.3, alpha=0.4)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlim(0, step.ms)
    notes = (["grey lines: the device hands q to the CPU"] if step.stores else []) + ["black ticks: the main thread issues a layer's attention"]
    if not (step.copies or step.waits or step.kernels):
        notes.append("no device profiled: its rows stay empty")
    ax.set_xlabel(f"ms from the step's start ({'; '.join(notes)})")
    ax.set_title(title or f"one decode step, {step.ms:.1f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


def _shift(e: DeviceEvent, off: int) -> DeviceEvent:
    return DeviceEvent(e.name, e.stream, e.start - off, e.end - off)


@dataclass
class Timeline:
    """:func:`decode_timeline`'s result: the profiled steps, and how the device's clock was placed
    on the host's (``"flags"`` or ``"sync"``, see :func:`flag_offset` and :func:`sync_offset`;
    ``"host"`` without a device) with its uncertainty in ns."""

    steps: list[StepTimeline]
    aligned_by: str
    uncertainty_ns: int | None


def decode_timeline(llm, prompt_token_ids: list[list[int]], steps: int = 3, skip: int = 2) -> Timeline:
    """Generate with the prompts and lay ``steps`` decode steps after ``skip`` others out in time
    (see the module doc): the native CPU worker records its jobs, the main thread each decode
    call's entry, and on CUDA torch's profiler the device's kernels and copies (CUPTI only).

    Args:
        llm: a loaded :class:`~writescope.engine.llm.LLM` (its current policy is used).
        prompt_token_ids: the batch's prompts.
        steps, skip: decode steps laid out (>= 1), and decode steps run first (>= 0).

    Raises:
        ValueError: steps < 1 or skip < 0; and whatever ``generate`` raises for the prompts.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    check_steps(steps, skip)
    cuda = llm.device.type == "cuda"
    decoder = getattr(llm.cache, "decoder", None)
    stamps: list[int] = []  # perf_counter_ns after each decode step (synchronised)
    issues: list[int] = []  # perf_counter_ns as the main thread enters each decode call's attention
    traced: list = []  # the native workers, once made (by the first decode step with a CPU part): (worker, kind)
    experts = getattr(llm, "expert_worker", None)
    # the profiler's step 0 holds the prefill and the first decode step: wait; then skip warm-up steps
    prof = profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=1, warmup=skip, active=steps, repeat=1)) if cuda else None

    def on_step():
        synchronize(llm.device)
        stamps.append(time.perf_counter_ns())
        native = getattr(decoder, "worker", None)
        expert = getattr(experts, "running", None)
        for w, kind in ((native, "attention"), (expert, "experts")):
            if w is not None and all(t is not w for t, _ in traced):
                w.trace(True)
                traced.append((w, kind))
        if prof is not None:
            prof.step()

    try:
        run_decode_steps(llm, prompt_token_ids, steps, skip, on_step, on_attention=lambda: issues.append(time.perf_counter_ns()), around=prof)
    finally:
        recorded = [(rec, kind) for w, kind in traced for rec in w.take_trace()]
        for w, _ in traced:
            w.trace(False)
    window = stamps[skip : skip + steps + 1]  # laid-out step j runs from stamp j - 1 to stamp j
    if len(window) < 2:
        return Timeline([], "host", None)
    jobs = [Job(t, s, d, kind) for (_, t, s, d), kind in recorded if window[0] <= s < window[-1]]
    device, aligned_by, uncertainty = [], "host", None
    if prof is not None:
        device = device_events(prof.profiler.kineto_results.events())
        by_flags = flag_offset(device, jobs)
        if by_flags is not None:
            (off, uncertainty), aligned_by = by_flags, "flags"
        elif device:
            off, aligned_by = sync_offset(device, window[-1]), "sync"
        device = [_shift(e, off) for e in device] if aligned_by != "host" else []
    return Timeline(build_steps(list(zip(window, window[1:])), device, jobs, issues), aligned_by, uncertainty)

