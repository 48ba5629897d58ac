"""The rates a decode step's bound is computed from, measured in the benchmark's own run.

A split step reads its host-resident KV over two paths at once: the CPU reads the compute region
in place, the link carries the load region to the GPU. Both draw on host memory, so each runs
slower while the other does (the H200 machine, run 18 of benchmarks/results/gpu_decode_h200.md:
52.7 GB/s host-to-GPU during a CPU read against 55.1 alone, the CPU 76.8 GB/s during a copy
against 116.4 alone). The split bound of a step is its host-resident KV bytes over the sum of the
two contended rates; streaming alone is bound by the link's own rate.

:func:`measure` takes (best of ``repeats`` for the stand-alone rates):
- the host read rate: a float32 sum of a host buffer of at least four times the last-level cache
  (so it is read from DRAM, not from the cache: the H200 host has 300 MiB of L3), on the threads
  the CPU attention gets (:func:`writescope.engine.threads.default_attention_threads`);
- on CUDA, the pinned host-to-device copy rate of a 256 MiB buffer (registered for the
  measurement and released after it, so no device or pinned memory stays reserved);
- on CUDA, both at once: copies of that buffer issued on a side stream, timed by events, while
  this thread sums the host buffer until the last copy has finished; each side's rate is its
  bytes over its own span.
Without CUDA there is no link: the 'GPU' side reads host memory too, and both bounds are the host
read rate.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from writescope.scheduler.limits import best_seconds

COPY_BYTES = 256 * 2**20  # copies this large reach the link's rate (HARDWARE.md's copy-size table)
CACHE_MULTIPLE = 4  # the host buffer is at least this many last-level caches
MIN_READ_BYTES, MAX_READ_BYTES = 256 * 2**20, 4 * 2**30


@dataclass(frozen=True)
class Rates:
    """Measured (or given) rates in GB/s.

    Attributes:
        cpu_alone: host read, nothing else running.
        h2d_alone: pinned host-to-device copy alone (None without CUDA).
        cpu_with_h2d, h2d_with_cpu: each while the other runs (None without CUDA, or not measured).
        source: how they were obtained, in words.
    """

    cpu_alone: float
    h2d_alone: float | None = None
    cpu_with_h2d: float | None = None
    h2d_with_cpu: float | None = None
    source: str = "given"

    def split_gbs(self) -> float:
        """GB/s of both paths at once: the contended rates' sum where measured, else the sum of
        the stand-alone ones (the link's absent: the host read)."""
        if self.cpu_with_h2d is not None and self.h2d_with_cpu is not None:
            return self.cpu_with_h2d + self.h2d_with_cpu
        return self.cpu_alone + (self.h2d_alone or 0.0)

    def stream_gbs(self) -> float:
        """GB/s of streaming alone: the link's rate (the host read without a link)."""
        return self.h2d_alone if self.h2d_alone is not None else self.cpu_alone

    def line(self) -> str:
        """One line for a benchmark's output."""
        if self.h2d_alone is None:
            return f"bound rates ({self.source}): host read {self.cpu_alone:.1f} GB/s (no link: both sides read host memory)"
        both = ""
        if self.cpu_with_h2d is not None and self.h2d_with_cpu is not None:
            both = f"; at once: host-to-GPU {self.h2d_with_cpu:.1f} and CPU {self.cpu_with_h2d:.1f}"
        return (f"bound rates ({self.source}): host-to-GPU {self.h2d_alone:.1f} GB/s alone, host read {self.cpu_alone:.1f} alone"
                f"{both}; split bound {self.split_gbs():.1f} GB/s, streaming alone {self.stream_gbs():.1f}")

    def to_dict(self) -> dict:
        return asdict(self)


def given(h2d_gbs: float, cpu_gbs: float, cuda: bool) -> Rates:
    """Rates given by hand (``--h2d-gbs``, ``--cpu-gbs``), taken as what both paths reach at once.

    Raises:
        ValueError: a rate that is not positive.
    """
    for name, x in (("--h2d-gbs", h2d_gbs), ("--cpu-gbs", cpu_gbs)):
        if not x > 0:
            raise ValueError(f"{name} must be a positive rate in GB/s, got {x}")
    return Rates(cpu_gbs, h2d_gbs if cuda else None, source="given")


def last_level_cache_bytes() -> int | None:
    """The machine's last-level cache in bytes: the highest cache level's size summed over its
    instances (each shared by a set of CPUs: one per socket on the H200's Xeon, one per core
    complex on an AMD EPYC), from Linux sysfs; None where it is not readable."""
    import glob
    import os

    found: dict[str, tuple[int, int]] = {}  # shared CPU list -> (level, bytes)
    for d in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int(open(os.path.join(d, "level")).read())
            shared = open(os.path.join(d, "shared_cpu_list")).read().strip()
            text = open(os.path.join(d, "size")).read().strip().upper()
            kind = open(os.path.join(d, "type")).read().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if kind != "Instruction" and digits.isdigit():
            key = f"{level}:{shared}"
            found[key] = (level, int(digits) * scale)
    if not found:
        return None
    top = max(level for level, _ in found.values())
    return sum(size for level, size in found.values() if level == top)


def read_bytes_default() -> int:
    """The host buffer's size: ``CACHE_MULTIPLE`` last-level caches, within 256 MiB - 4 GiB."""
    llc = last_level_cache_bytes() or 0
    return max(MIN_READ_BYTES, min(MAX_READ_BYTES, CACHE_MULTIPLE * llc))


def measure(device: torch.device, read_bytes: int | None = None, copy_bytes: int = COPY_BYTES, repeats: int = 3) -> Rates:
    """The rates of this machine now (module docstring); a few seconds on CUDA.

    Args:
        device: where the 'GPU' side runs.
        read_bytes: the host buffer (default :func:`read_bytes_default`).
        copy_bytes: the pinned buffer copied to the device (CUDA).
        repeats: best of this many timings of each stand-alone rate.
    """
    from writescope.engine.threads import default_attention_threads, intra_op_threads
    from writescope.kvcache.pinned import host_empty, unpin

    cuda = device.type == "cuda"
    n = (read_bytes or read_bytes_default()) // 4 * 4
    host = torch.ones(n // 4, dtype=torch.float32)
    with intra_op_threads(default_attention_threads(device)):
        cpu_alone = n / best_seconds(lambda: host.sum(), repeats) / 1e9
        if not cuda:
            return Rates(cpu_alone, source=f"measured in this run, a {n >> 20} MiB read")
        m = copy_bytes // 4 * 4
        pinned = host_empty((m,), torch.uint8, pin=True)
        pinned.fill_(1)
        dst = torch.empty(m, dtype=torch.uint8, device=device)
        try:
            def copy():
                dst.copy_(pinned, non_blocking=True)
                torch.cuda.synchronize(device)

            h2d_alone = m / best_seconds(copy, repeats) / 1e9
            # both at once: enough copies to outlast several host reads, the host reading until they end
            copies = max(4, int(0.25 * h2d_alone * 1e9 / m) + 1)  # about a quarter of a second of copying
            side = torch.cuda.Stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            with torch.cuda.stream(side):
                start.record(side)
                for _ in range(copies):
                    dst.copy_(pinned, non_blocking=True)
                end.record(side)
            reads, t0 = 0, time.perf_counter()
            while not end.query() or reads == 0:
                host.sum()
                reads += 1
            cpu_s = time.perf_counter() - t0
            end.synchronize()
            h2d_s = start.elapsed_time(end) / 1e3
        finally:
            torch.cuda.synchronize(device)
            del dst
            unpin(pinned)
            torch.cuda.empty_cache()  # nothing of the measurement stays reserved against a budget
    return Rates(cpu_alone, h2d_alone, reads * n / cpu_s / 1e9, copies * m / h2d_s / 1e9,
                 source=f"measured in this run, a {n >> 20} MiB read and {m >> 20} MiB copies")
