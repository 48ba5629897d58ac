"""Where the time of a decode step goes: the named ranges of the engine under torch's profiler.

The engine marks its parts with ``torch.profiler.record_function``:

| range | thread | what |
|---|---|---|
| ``attn.cpu_part`` | CPU worker | compute-region attention (overlaps the main thread's ranges; taken from the decoder's own timer, as the profiler sees only the main thread) |
| ``attn.q_to_host`` | main | issuing the queries' copy to pinned host memory (no wait; the worker waits for it, in ``attn.wait_cpu``) |
| ``attn.window`` | main | D-window attention on the device |
| ``attn.load_region`` | main | streaming the load region through the ping-pong buffers + its attention |
| ``attn.monolithic_prepare`` | main | the monolithic baseline's re-layout into pinned staging |
| ``attn.wait_cpu`` | main | waiting for the CPU worker (which first waits for the queries' copy: the device's queue up to this layer) |
| ``attn.merge`` | main | the lse merge of all partials |
| ``kv.append`` / ``kv.evict`` / ``kv.drain`` | main | D-window writes, window evictions, staged compute blocks written home |
| ``moe.router`` / ``moe.device_experts`` / ``moe.host_experts`` / ``moe.shared_experts`` | main | expert phase |
| ``moe.tokens_to_host`` | main | the host experts' tokens copied to the host (waits for the device) |
| ``moe.streamed_experts`` | main | host experts whose weights are streamed to the device and computed there |
| ``moe.host_experts_in_place`` | main | host experts read in place over PCIe by the fused kernels (``WRITESCOPE_MOE_KERNEL=fused``, the default) |
| ``moe.experts_async`` | main | the routed experts of a pass whose host experts are split on the device, the CPU's share on the native expert worker (moe/async_experts.py): issuing only |
| ``decode.stage_graph`` | main | a decode stage replayed as a CUDA graph (models/graphs.py): the projections, norms and expert phase of the stages captured, whose own ranges (``moe.*``) then do not appear; ``WRITESCOPE_CUDA_GRAPHS=off`` splits them again |

For each, per step: CPU wall time (time spent inside the range on its thread, including waiting
for the device when the range synchronises); device span (on the GPU, from the first kernel or copy
the range launched to the end of its last, idle gaps included); device busy time (the sum of those
kernels' and copies' durations), each the mean over the profiled steps. ``other`` is the mean
step time minus the main thread's ranges: projections, norms, sampling, Python. (The median step,
printed first, is the figure to compare; ``other`` takes the mean so that one slow step, which
adds to the ranges' totals, adds to the step it is taken from too.)

With CUDA, torch's profiler reports a ``record_function`` range twice in ``key_averages()``: a CPU
entry (its CPU time, and the summed durations of the kernels launched inside) and a GPU-side
user-annotation entry (its span on the GPU, no CPU time); the two are grouped apart because
``device_type`` is part of the grouping key (torch/autograd/profiler_util.py, ``get_key``, read
in torch 2.13; the zeros of the H200 profiles under torch 2.11 match it).
``range_times`` reads each from its own entry. Breakdowns written before that (code up to
e3f4873: ``profile_*_h200.json``) kept only the GPU-side entry of a range with device work, so
their CPU time for it reads 0, and its CPU time went into ``other``.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile, schedule

from writescope.bench.profiled_steps import check_steps, run_decode_steps
from writescope.engine.timing import synchronize

WORKER_RANGES = ("attn.cpu_part",)
MAIN_RANGES = (
    "attn.q_to_host", "attn.window", "attn.load_region", "attn.monolithic_prepare", "attn.wait_cpu", "attn.merge",
    "kv.append", "kv.evict", "kv.drain", "moe.router", "moe.tokens_to_host", "moe.device_experts", "moe.host_experts",
    "moe.streamed_experts", "moe.host_experts_in_place", "moe.experts_async", "moe.shared_experts", "decode.stage_graph",
)


@dataclass(frozen=True)
class RangeTime:
    """One range's times in ms per step (see the module doc)."""

    cpu_ms: float
    device_ms: float = 0.0  # span on the GPU
    device_busy_ms: float = 0.0  # kernels and copies inside it, summed


@dataclass
class Breakdown:
    step_ms: float  # median wall time of a profiled decode step
    steps: int
    ranges: dict[str, RangeTime]  # each the mean over the profiled steps
    device_timed: bool = True  # device columns measured (CUDA); without CUDA the table leaves them out
    step_mean_ms: float | None = None  # mean wall time of a profiled step (None: taken as step_ms)

    @property
    def mean_ms(self) -> float:
        """The mean step (ms), which the ranges' per-step times are averages over."""
        return self.step_ms if self.step_mean_ms is None else self.step_mean_ms

    @property
    def other_ms(self) -> float:
        """Mean step time outside the main thread's named ranges (ms per step, >= 0)."""
        return max(0.0, self.mean_ms - sum(t.cpu_ms for n, t in self.ranges.items() if n not in WORKER_RANGES))

    def table(self) -> str:
        """The breakdown as text, ranges by CPU time. The main thread's rows and ``other`` add up
        to the step; the worker's row (in brackets) overlaps them."""
        dev = f" {'device span ms':>15s} {'device busy ms':>15s}" if self.device_timed else ""
        lines = [f"decode step {self.step_ms:.2f} ms (median of {self.steps} profiled steps, mean {self.mean_ms:.2f}; profiler overhead included)",
                 f"{'range':24s} {'thread':7s} {'CPU ms/step':>12s} {'% of mean':>10s}{dev}"]
        for name, t in sorted(self.ranges.items(), key=lambda kv: -kv[1].cpu_ms):
            worker = name in WORKER_RANGES
            pct = f"{100 * t.cpu_ms / self.mean_ms:.1f}%"
            cols = f" {t.device_ms:15.3f} {t.device_busy_ms:15.3f}" if self.device_timed else ""
            lines.append(f"{name:24s} {'worker' if worker else 'main':7s} {t.cpu_ms:12.3f} {f'({pct})' if worker else pct:>10s}{cols}")
        other = self.other_ms
        lines.append(f"{'other (main)':24s} {'main':7s} {other:12.3f} {f'{100 * other / self.mean_ms:.1f}%':>10s}")
        if self.device_timed:
            lines.append("device span: first to last GPU work launched in the range, idle gaps included; busy: that work's durations summed")
        return "\n".join(lines)


def range_times(events, steps: int) -> dict[str, RangeTime]:
    """Per-step times of the main thread's named ranges from ``profile.key_averages()``.

    Args:
        events: entries with ``key``, ``device_type`` (``torch.autograd.DeviceType``),
            ``cpu_time_total`` and ``device_time_total`` (microseconds over all profiled steps).
        steps: profiled steps to divide by (>= 1).

    A range's CPU entry gives its CPU time and busy device time; its device-side entries (one per
    device) its span. Entries of other names are ignored.
    """
    from torch.autograd import DeviceType

    acc: dict[str, list[float]] = {}
    for ev in events:
        if ev.key not in MAIN_RANGES:
            continue
        t = acc.setdefault(ev.key, [0.0, 0.0, 0.0])
        dev = getattr(ev, "device_time_total", 0.0) or 0.0
        if ev.device_type == DeviceType.CPU:
            t[0] += ev.cpu_time_total
            t[2] += dev
        else:
            t[1] += dev
    return {k: RangeTime(c / 1e3 / steps, d / 1e3 / steps, b / 1e3 / steps) for k, (c, d, b) in acc.items()}


def decode_breakdown(llm, prompt_token_ids: list[list[int]], steps: int = 8, skip: int = 2, trace: str | None = None) -> Breakdown:
    """Generate with the prompts and profile ``steps`` decode steps after ``skip`` unprofiled ones.

    Args:
        llm: a loaded :class:`~writescope.engine.llm.LLM` (its current policy is used).
        prompt_token_ids: the batch's prompts.
        steps, skip: decode steps profiled, and decode steps run first (warm-up).
        trace: write a Chrome trace (``chrome://tracing``, Perfetto) here.

    Raises:
        ValueError: steps < 1 or skip < 0; and whatever ``generate`` raises for the prompts.
    """
    check_steps(steps, skip)
    cuda = llm.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    stamps: list[float] = []
    worker: list[float] = []  # the CPU worker's attention seconds so far (its thread is not profiled)
    stats = getattr(getattr(llm.cache, "decoder", None), "stats", None)

    def on_step():
        synchronize(llm.device)
        stamps.append(time.perf_counter())
        worker.append(stats.cpu_seconds if stats is not None else 0.0)
        prof.step()

    # step 0 holds the prefill and the first decode step: wait; then skip warm-up steps
    with warnings.catch_warnings():  # skip 0 asks for no warm-up step on purpose (torch warns of it)
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
        prof = profile(activities=acts, schedule=schedule(wait=1, warmup=skip, active=steps, repeat=1))
    run_decode_steps(llm, prompt_token_ids, steps, skip, on_step, around=prof)
    if trace:
        prof.export_chrome_trace(trace)
    active = stamps[skip : skip + steps + 1]  # profiled step j runs from stamp j - 1 to stamp j
    walls = [(b - a) * 1e3 for a, b in zip(active, active[1:])]
    step_ms = statistics.median(walls) if walls else float("nan")
    ranges = {}
    if stats is not None and worker[skip + steps] > worker[skip]:
        ranges["attn.cpu_part"] = RangeTime((worker[skip + steps] - worker[skip]) * 1e3 / steps)
    ranges.update(range_times(prof.key_averages(), steps))
    return Breakdown(step_ms, steps, ranges, device_timed=cuda, step_mean_ms=statistics.fmean(walls) if walls else None)
