"""Calibration of the roofline inputs A, B, C_cpu, C_gpu on this machine (docs/DESIGN.md section 5).

For the model's KV shape, an InplaceKVCache of ``STEP_LAYERS`` layers is filled with random KV
for a batch at a few context lengths and CPU shares (static R, both sides busy) and decoded for a
few steps, each step all its layers one after another as the decode path runs them (the next
layer's blocks streaming while this one computes), synchronised only around the whole step: a
first version timed one layer with a synchronisation before and after it, which stopped the
streaming across layers and put every fixed cost too high (issue 15). Each step gives, per layer
step (its totals over the layers divided by ``STEP_LAYERS``), two points:

- the CPU part's wall time (the worker's own timer) against its compute-region tokens: the
  slope is A (seconds per token), the intercept C_cpu;
- the GPU part's device time (CUDA events from the D-window attention to the last streamed
  block) against its load-region tokens: the slope is B, the intercept C_gpu (the D-window part
  is in C_gpu).

Both sides are measured while the other runs, as in a split step: host DRAM bandwidth is shared
by the DMA and the CPU reads, so each side is slower than alone (a first version measured each
side alone and put the share too high: the one-layer sweep in benchmarks/results found its best
at R = 0.25-0.31 at 16K-32K where the uncontended costs said 0.44).

For the split check (:func:`writescope.scheduler.roofline.split_pays`) steps at share 0 (streaming
alone, no CPU part) are measured too: the line of their device time (the same events as the GPU
part's) against the streamed tokens gives B_alone and C_gpu_alone, so the check compares each side's
own time with streaming alone's own time. Every step's wall time is taken as well (synchronised
before and after the whole step on CUDA, ``points["alone"]`` at share 0); at the split shares the
median of wall time minus the slower side's time is the loop's hand-over (``detail["loop_handover_s"]``).
It is not the roofline's C_split (left 0; the gate with O charges the whole step's measured
hand-over, ``roofline.SPLIT_HANDOVER``, 0.15 ms): this loop runs attention only, and there the hand-over
(q to the CPU, its flag back, the merge, the next layer's q) is 1.7-2.4 ms per layer on the H200,
while in whole-model steps, where each layer has its projections and experts to run, the split's
time outside attention matched streaming alone's within 0.5 ms per layer and its attention
matched the larger of its two sides within 15% (benchmarks/results/gpu_decode_h200.md, runs
20-21). Counted, the loop's figure kept r = 0 on Qwen3-30B-A3B 4 x 32K (run 21), where a share
of 0.5 ran 1.20x faster than streaming alone.

Least-squares lines through the medians; slopes floored at 1e-12 s, intercepts at 0. A fit that
cannot be true (:mod:`writescope.scheduler.limits`: faster than this machine's measured host read
or host-to-device rate, a time that does not grow with the tokens, a fixed cost above the fastest
step or well below 0) is measured again once; one still impossible is held inside the limits and
listed in ``detail["implausible"]`` (the CLI prints it as such). Results are
stored as JSON in ``$XDG_CACHE_HOME/writescope/calibration.json`` keyed by machine (CPU model,
cores, torch threads, GPU, the CPU attention backend) and KV shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from writescope.attention import cpu_kernel
from writescope.attention.metadata import ForwardBatch
from writescope.budget.memory import available_memory
from writescope.config import KVLayout
from writescope.engine.timing import synchronized_seconds
from writescope.errors import ArgError
from writescope.kvcache.inplace import InplaceKVCache
from writescope.kvcache.spec import DEFAULT_PINGPONG_BUFFERS, PartitionSpec, Roofline, load_read_from_env, pingpong_buffers_from_env
from writescope.paths import cache_dir
from writescope.scheduler import limits as lim
from writescope.scheduler.policies import StaticPolicy

CUDA_CONTEXTS = (4096, 16384, 32768)  # tokens per sequence: the per-token costs dominate the fixed ones
CPU_CONTEXTS = (512, 1024, 2048)
STEP_LAYERS = 3  # layers of one calibration step, timed whole (issue 15: no synchronisation between layers)
# stored with a calibration; one measured otherwise is measured again (", no loop C_split, alone by device
# time": before it, C_split held the attention-only loop's hand-over, which kept splits that pay at r = 0,
# and streaming alone was fitted to wall times)
METHOD = f"whole steps of {STEP_LAYERS} layers, no loop C_split, alone by device time"
SHARES = (0.25, 0.5)  # CPU shares measured: around where split steps run
HOST_FRACTION = 0.5  # a calibration point may use at most this fraction of the available host memory


def machine_key(device: torch.device) -> str:
    """CPU model, core count, torch threads, GPU name and, where selected (the default), the CPU
    attention kernel and its path instead of torch's flash op (``WRITESCOPE_CPU_ATTENTION``), and a
    ping-pong buffer count or load-region read other than the default: what A, B and the loop's hand-over depend on. (Keys stored before the kernel was part of it stay valid for the flash op.)"""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no-gpu"
    key = f"{cpu}|{os.cpu_count()} cpus|{torch.get_num_threads()} threads|{gpu}"
    buffers = pingpong_buffers_from_env()
    if buffers != DEFAULT_PINGPONG_BUFFERS:  # how far the link runs ahead of a layer's CPU wait: B and the hand-over
        key += f"|{buffers} ping-pong buffers"
    if load_read_from_env() != "copy":  # the load region read in place by the kernels: B and C_gpu
        key += f"|load read {load_read_from_env()}"
    backend = cpu_kernel.backend_key()
    return key if backend == "flash" else f"{key}|cpu attention {backend}"


def shape_key(layout: KVLayout, q_heads: int, dtype: torch.dtype, window: int) -> str:
    kind = "latent" if layout.shared_kv else "kv"
    return f"{kind} kv_heads={layout.kv_heads} k={layout.k_dim} v={layout.v_dim} q_heads={q_heads} {dtype} D={window}"


def calibrate(
    layout: KVLayout,
    q_heads: int,
    dtype: torch.dtype,
    device: torch.device | str,
    window: int = 256,
    batch: int = 16,
    contexts: tuple[int, ...] | None = None,
    steps: int = 6,
    cpu_threads: int | None = None,
    progress: bool = True,
    shares: tuple[float, ...] = SHARES,
    remeasure: int = 1,
) -> tuple[Roofline, dict]:
    """Measure A, B, C_cpu, C_gpu for this KV shape on this machine.

    Contexts whose KV would take more than half the available host memory are skipped. The
    machine's host read (and, on CUDA, host-to-device) rate is measured first; the points of a
    fit outside those limits are measured again up to ``remeasure`` times (the split shares, or
    streaming alone at share 0), and a fit still outside them is clamped to them.

    Returns:
        ``(roofline, detail)``: detail holds the measured points ``(tokens, seconds)`` per side
        (``alone_gpu``: the device time of the share-0 steps, next to their wall time ``alone``),
        ``loop_handover_s`` (seconds per layer a split step of this loop took beyond its slower side),
        the contexts and shares used, ``limits`` (the measured rates, GB/s) and ``implausible``
        (what stayed impossible after the re-measures, one sentence each; empty when nothing did).

    Raises:
        ValueError: batch, steps or a context below 1, a share outside (0, 1), or fewer than
            two contexts that fit host memory.
    """
    device = torch.device(device)
    contexts = contexts or (CUDA_CONTEXTS if device.type == "cuda" else CPU_CONTEXTS)
    if batch < 1 or steps < 1 or min(contexts) < 1:
        raise ValueError(f"batch, steps and contexts must be >= 1, got {batch}, {steps}, {contexts}")
    if not all(0 < r < 1 for r in shares):
        raise ValueError(f"calibration shares must be in (0, 1) so both sides run, got {shares}")
    host = available_memory(torch.device("cpu"))
    per_token = layout.bytes_per_token(dtype.itemsize)
    fit = [L for L in contexts if host is None or STEP_LAYERS * batch * L * per_token <= HOST_FRACTION * host]
    if len(fit) < 2:
        raise ArgError(f"calibration needs two contexts that fit host memory; of {contexts} (batch {batch}) only {fit} fit: "
                       "lower batch", "batch")
    limits = lim.measure_limits(device, batch * max(fit) * per_token)
    points = {"cpu": [], "gpu": [], "alone": [], "alone_gpu": [], "split_overhead": []}
    bar = tqdm(total=(len(shares) + 1) * len(fit), desc="calibrate", disable=not progress)

    def measure(series: str) -> None:  # "alone": share 0; "split": the split shares
        for key in ("alone", "alone_gpu") if series == "alone" else ("cpu", "gpu", "split_overhead"):
            points[key] = []
        for share in (0.0,) if series == "alone" else shares:
            for L in fit:
                cpu, gpu, wall, overhead = _measure(layout, q_heads, dtype, device, window, share, batch, L, steps, cpu_threads)
                if share == 0:
                    points["alone"].append((gpu[0], wall))
                    points["alone_gpu"].append(gpu)  # its device time alone: wall minus this is the issue and hand-over both paths pay
                else:
                    points["cpu"].append(cpu)
                    points["gpu"].append(gpu)
                    points["split_overhead"].append(overhead)
                bar.update()

    fits = {"a": ("cpu", "cpu", "A and C_cpu (the CPU part)"), "b": ("gpu", "load", "B and C_gpu (the streamed part)"),
            "b_alone": ("alone_gpu", "load", "B alone and C_gpu alone (streaming alone)")}

    def wrong() -> dict[str, list[str]]:  # per series, what is impossible about its fits
        out: dict[str, list[str]] = {"split": [], "alone": []}
        for key, side, name in fits.values():
            out["alone" if key == "alone_gpu" else "split"] += lim.problems(name, points[key], per_token, *limits.max_gbs(side))
        return out

    measure("alone")
    measure("split")
    for _ in range(remeasure):
        bad = [series for series, found in wrong().items() if found]
        if not bad:
            break
        bar.total += sum(len(fit) * (1 if series == "alone" else len(shares)) for series in bad)
        what = " and ".join({"split": "split", "alone": "streaming-alone"}[b] for b in bad)
        bar.set_description(f"calibrate (measuring the {what} points again: their first fit looked implausible)")
        bar.refresh()
        for series in bad:
            measure(series)
    bar.close()
    implausible = [p for found in wrong().values() for p in found]
    (a, c_cpu), (b, c_gpu), (b_alone, c_gpu_alone) = (
        lim.clamped(points[key], per_token, limits.max_gbs(side)[0]) for key, side, _ in fits.values())
    handover = max(0.0, statistics.median(points["split_overhead"]))  # the loop's; not C_split (module docstring)
    roofline = Roofline(a, b, c_cpu, c_gpu, b_alone, c_gpu_alone, 0.0)
    return roofline, {"points": points, "batch": batch, "steps": steps, "contexts": fit, "shares": list(shares),
                      "loop_handover_s": handover,
                      "limits": {"host_read_gbs": limits.host_read, "load_gbs": limits.load, "load_path": limits.load_path,
                                 "read_bytes": limits.read_bytes},
                      "implausible": implausible}


def _measure(layout, q_heads, dtype, device, window, share, batch, L, steps, cpu_threads):
    """For one split: ``((cpu tokens, median CPU seconds), (load tokens, median GPU seconds),
    median wall seconds, median of wall minus the slower side's seconds)``, all per layer step.

    Each step decodes ``STEP_LAYERS`` layers one after another as a decode step does (the next
    layer's blocks stream while this one computes, the CPU parts hand over through the worker),
    synchronised only before and after the whole step; the GPU part of each layer is timed by
    events read after it, the CPU parts by the worker's own timer."""
    spec = PartitionSpec(layout, STEP_LAYERS, dtype, window=window)
    cache = InplaceKVCache(spec, StaticPolicy(share), device, cpu_threads)
    g = torch.Generator(device=device).manual_seed(L)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    try:
        cache.expect_batch(batch)
        slots = [cache.allocate(L + steps + 1, prompt_len=L) for _ in range(batch)]
        for s in slots:
            for layer in range(STEP_LAYERS):
                cache.write(s, layer, rnd(L, layout.kv_heads, layout.k_dim), None if layout.shared_kv else rnd(L, layout.kv_heads, layout.v_dim))
        cpu, gpu, wall, over = [], [], [], []
        dec = cache.decoder
        dec.time_gpu = True
        for t in range(steps + 1):
            inputs = [(rnd(batch, q_heads, layout.k_dim), rnd(batch, layout.kv_heads, layout.k_dim),
                       None if layout.shared_kv else rnd(batch, layout.kv_heads, layout.v_dim)) for _ in range(STEP_LAYERS)]
            fb = ForwardBatch.build(slots, [1] * batch, [cache.seq_len(s) for s in slots], device)
            timers, loads = [], 0
            before = dec.stats
            cpu_s0, cpu_t0 = before.cpu_seconds, before.cpu_tokens

            def step():
                nonlocal loads
                for layer, (q, k, v) in enumerate(inputs):
                    cache.attend(layer, q, k, v, fb, layout.k_dim**-0.5)
                    timers.append(dec.last_gpu_timer())
                    loads += dec.stats.last_load_tokens

            _, wall_s = synchronized_seconds(step, device)
            gpu_s = sum(dec.gpu_seconds(x) for x in timers)
            after = dec.stats  # every layer's CPU part is done: the device waited for it, and the sync for the device
            cpu_s, cpu_t = after.cpu_seconds - cpu_s0, after.cpu_tokens - cpu_t0
            if t > 0:  # the first step warms up
                n = STEP_LAYERS
                cpu.append((cpu_t // n, cpu_s / n))
                gpu.append((loads // n, gpu_s / n))
                wall.append(wall_s / n)
                over.append((wall_s - max(cpu_s, gpu_s)) / n)
        med = statistics.median
        return (cpu[0][0], med(x for _, x in cpu)), (gpu[0][0], med(x for _, x in gpu)), med(wall), med(over)
    finally:
        cache.close()


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of seconds against tokens; slope >= 1e-12, intercept >= 0
    (no physical limit: :func:`writescope.scheduler.limits.clamped` holds a fit inside those)."""
    slope, intercept = lim.line(points)
    return max(slope, 1e-12), max(0.0, intercept)


def store_path() -> Path:
    return cache_dir("") / "calibration.json"


def load(device: torch.device, shape: str) -> Roofline | None:
    """The stored calibration of this machine and shape, or None."""
    path = store_path()
    try:
        entry = json.loads(path.read_text())[machine_key(device)][shape]
        fields = {k: entry[k] for k in ("a", "b", "c_cpu", "c_gpu", "b_alone", "c_gpu_alone", "c_split")}
    except (OSError, ValueError, KeyError):  # none, or stored before the split check: measure again
        return None
    if entry.get("method") != METHOD:  # measured another way (one synchronised layer): measure again
        return None
    return Roofline(**fields)


def stored_entry(device: torch.device, shape: str) -> dict | None:
    """The whole stored calibration of this machine and shape (the fitted values, the measured
    points per side, the limits, what was implausible, when it was measured), or None: what a
    benchmark keeps next to its rows, so that a surprising r can be traced to its points."""
    try:
        entry = json.loads(store_path().read_text())[machine_key(device)][shape]
    except (OSError, ValueError, KeyError):
        return None
    return entry if entry.get("method") == METHOD else None  # one load() would measure again is not this calibration


def save(device: torch.device, shape: str, roofline: Roofline, detail: dict) -> Path:
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {}
    entry = {**dataclasses.asdict(roofline), "method": METHOD, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **detail}
    doc.setdefault(machine_key(device), {})[shape] = entry
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
    return path


def actionable(implausible: list[str], device) -> list[str]:
    """The clamped fits of ``implausible`` (``detail["implausible"]``) worth a warning on
    ``device``: all of them, except on the CPU those of the "GPU" side (B and B alone: CPU tensors
    standing in for a GPU, whose fits are often clamped and say nothing of a GPU machine)."""
    cpu = torch.device(device).type == "cpu"
    return [p for p in implausible if not (cpu and p.startswith("B"))]


def load_or_calibrate(layout, q_heads, dtype, device, window=256, cpu_threads=None, progress=True) -> Roofline:
    """The stored calibration, or a fresh one (stored) when there is none."""
    device = torch.device(device)
    shape = shape_key(layout, q_heads, dtype, window)
    found = load(device, shape)
    if found is not None:
        return found
    roofline, detail = calibrate(layout, q_heads, dtype, device, window, cpu_threads=cpu_threads, progress=progress)
    save(device, shape, roofline, detail)
    bad = actionable(detail["implausible"], device)
    if bad:
        warnings.warn(f"calibration: {len(bad)} fit(s) CLAMPED to this machine's limits (measured twice, still "
                      "impossible; a busy or noisy machine does this). The run goes on; only the CPU share writescope picks "
                      "may be off. To measure again: `writescope calibrate` on a quieter machine. "
                      f"Details: {'; '.join(bad)}", stacklevel=2)
    return roofline
