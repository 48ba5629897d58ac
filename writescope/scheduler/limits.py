"""Physical limits a calibration's fits must respect (issue 19 item 4).

A fitted line ``seconds = slope x tokens + intercept`` through a calibration's points is a
claim about the machine: ``bytes_per_token / slope`` is the rate the tokens' KV was read at,
``intercept`` the fixed cost of a step. Noise can make either impossible (on the CPU a first
version printed ``B alone 0.001 ns/token = 256000.0 GB/s`` next to a fixed cost of 107 ms from
steps of a few ms). A fit is refused when

- the time does not grow with the tokens (slope <= 0: the per-token cost is below the noise);
- it reads faster than this machine can: above ``READ_MARGIN`` times the host read rate measured
  here (the CPU side, and the 'GPU' side when it runs as CPU tensors), or ``LINK_MARGIN`` times
  the pinned host-to-device copy rate measured here (the streamed load region on CUDA);
- its fixed cost is above the fastest step measured (the per-token part cannot be negative), or
  negative by more than ``NEGATIVE_SHARE`` of that step.

The rates are measured on a buffer the size of the calibration's largest KV, so a working set
that fits the CPU's caches is compared with a cached read. The host-read margin is generous:
torch's reduction is not the fastest reader there is and one measurement is one sample. The link's
is not: the measured pinned copy is the transfer itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

READ_MARGIN = 2.0  # a fit may read up to 2x the measured host read rate
# and stream up to 1.05x the measured pinned host-to-device rate: that copy is the DMA itself, not a
# slower stand-in. (At 1.5x, the H200's first whole-step calibration kept B at 73.0 GB/s against a
# 55.4 GB/s copy: the next layer's copies run while this layer's CPU part does, so the split step's
# GPU slope hides part of the streaming, and r(L) came out below the balance point; run 11,
# benchmarks/results/gpu_decode_h200.md.)
LINK_MARGIN = 1.05
NEGATIVE_SHARE = 0.25  # a negative fixed cost within 25% of the fastest step is noise (floored at 0)
MIN_BYTES, MAX_BYTES = 16 * 2**20, 512 * 2**20  # the measured buffer's size bounds


@dataclass(frozen=True)
class Limits:
    """Measured rates, GB/s: ``host_read`` (the CPU reading host memory) and ``load`` (the load
    region's path: pinned host-to-device on CUDA, a host read on the CPU)."""

    host_read: float
    load: float
    load_path: str  # how ``load`` was measured, in words
    read_bytes: int = 0  # the buffer read (0: not given); one that fits the CPU's caches is read from them

    def max_gbs(self, side: str) -> tuple[float, str]:
        """``(GB/s a fit of this side may reach, the limit in words)``; ``side`` "cpu" or "load"."""
        if side == "cpu":
            return READ_MARGIN * self.host_read, f"{READ_MARGIN:g}x this machine's host read rate of {self.host_read:.1f} GB/s"
        margin = LINK_MARGIN if self.load_path.startswith("pinned") else READ_MARGIN
        return margin * self.load, f"{margin:g}x this machine's {self.load_path} rate of {self.load:.1f} GB/s"


def best_seconds(fn, repeats: int = 5) -> float:
    """The fastest of ``repeats`` timings of ``fn()`` (seconds, at least 1 ns), after one untimed call."""
    fn()  # warm: pages touched, caches and threads up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure_limits(device: torch.device, nbytes: int) -> Limits:
    """The host read rate (best of 5 sums of a float32 buffer of ``nbytes``, clamped to 16-512 MiB,
    on torch's threads) and, on CUDA, the pinned host-to-device copy rate of the same buffer."""
    n = max(MIN_BYTES, min(MAX_BYTES, int(nbytes))) // 4 * 4
    host = torch.ones(n // 4, dtype=torch.float32)
    read = n / best_seconds(lambda: host.sum()) / 1e9
    if device.type != "cuda":
        return Limits(read, read, "host read", n)
    pinned = host.view(torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device=device)

    def copy():
        dst.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(device)

    link = n / best_seconds(copy) / 1e9
    del dst, pinned
    return Limits(read, link, "pinned host-to-device copy", n)


def line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of seconds against tokens, unfloored (one x value:
    the line through the origin and the mean)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else my / max(mx, 1)
    return slope, my - slope * mx


def problems(name: str, points: list[tuple[int, float]], token_bytes: int, max_gbs: float, limit: str) -> list[str]:
    """What is impossible about the line through ``points`` (tokens, seconds) of KV of
    ``token_bytes`` bytes per token, read no faster than ``max_gbs`` GB/s (``limit`` says where
    that bound comes from); ``name`` names the fit in the messages. Empty when it can be true."""
    slope, intercept = line(points)
    fastest = min(y for _, y in points)
    out = []
    if slope <= 0:
        out.append(f"{name}: the time does not grow with the tokens (slope {slope * 1e9:.3f} ns/token): the per-token "
                   "cost is below the noise of these steps")
    elif token_bytes / slope / 1e9 > max_gbs:
        out.append(f"{name}: {slope * 1e9:.3f} ns/token = {token_bytes / slope / 1e9:.1f} GB/s is faster than {limit} "
                   f"({max_gbs:.1f} GB/s)")
    if intercept > fastest:
        out.append(f"{name}: a fixed cost of {intercept * 1e3:.3f} ms per step is more than the fastest step measured "
                   f"({fastest * 1e3:.3f} ms)")
    elif intercept < -NEGATIVE_SHARE * fastest:
        out.append(f"{name}: a negative fixed cost of {intercept * 1e3:.3f} ms per step (the fastest step took "
                   f"{fastest * 1e3:.3f} ms)")
    return out


def clamped(points: list[tuple[int, float]], token_bytes: int, max_gbs: float) -> tuple[float, float]:
    """The line through ``points`` held inside the limits: the slope no faster than ``max_gbs``
    GB/s, the intercept in [0, the fastest step's seconds]. Where the slope is raised to the limit,
    the intercept is fitted again for it (least squares with the slope given: the line through the
    points' mean), not kept from the steeper-than-possible line: a fit that read too fast had
    put the time it missed into its fixed cost (run 20 on the H200: B fitted at 66.9 GB/s against a
    54.7 GB/s copy, C_gpu 2.08 ms), and with the slope held that time would count twice."""
    slope, intercept = line(points)
    held = max(slope, token_bytes / (max_gbs * 1e9), 1e-12)
    if held != slope:
        n = len(points)
        intercept = sum(y for _, y in points) / n - held * sum(x for x, _ in points) / n
    return held, min(max(0.0, intercept), min(y for _, y in points))
