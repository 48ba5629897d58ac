"""O: a decode layer step's work outside attention, measured on the real decode path.

Between one layer's attention (its merge issued) and the next layer's (its KV append) the GPU runs
the layer's output projection, its experts and the next layer's norms and q/k/v projections. Two
things follow for the split gate (:func:`writescope.scheduler.roofline.split_pays`):

- Streaming alone hides its copies behind this work: the load region's blocks of layer l+1 stream
  while layer l runs its experts. So a step of streaming alone takes about
  max(O + C_gpu_alone, B_alone L + C_gpu_alone) per layer, not the sum. On the H200 machine at DeepSeek-V2-Lite 4 x 8K, `gpu` attended a layer in
  0.383 ms of device time (98.7 GB/s, above the link's 54 GB/s), O was 0.67 ms, and the
  attention-only calibration line said 0.93 ms for streaming alone.
- A split's CPU part cannot hide there: it needs this layer's q. A split step takes
  max(O + max(T_cpu(r), C_gpu), T_gpu(r)) + C_split per layer.

Without O the gate deployed r = 0.03 at DSV2 4 x 8K and ran at 0.75x `gpu`
(benchmarks/results/evaluation_h200.md). Host experts read in place over PCIe inside O use the
link as well: their link time is added to the link's side (``link_seconds``).

O is measured as the time from one layer's attention end to the next layer's attention begin within
a decode step. On CUDA that is a pair of timing events on the current stream, read once they have
completed, with no synchronisation added; without CUDA it is the wall clock. Only some steps are
measured: after the first step at each batch size, the next ``warm``, then every ``every``-th. The
first is left out because it captures that size's CUDA graphs (models/graphs.py) in its gaps. Each
measured step's median gap is one sample for its batch size, tracked as A is: an
:class:`~writescope.scheduler.roofline.OnlineEstimate`, whose median of the last three samples
keeps one slow step from moving it. Steps split into two micro-batches are not measured, since their halves interleave.

A batch is placed when its prompts are written, before its first decode step, so the first
``generate`` of a process would place its prompts with the gate's form without O. With a
``store_key`` (the engine gives one on CUDA: :func:`store_key`), the estimates are kept in
``$XDG_CACHE_HOME/writescope/other_work.json`` (:meth:`OtherWork.save`), and a later process of
the same machine, model shape, expert placement and kernels starts from them.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from writescope.paths import cache_dir
from writescope.scheduler.roofline import OnlineEstimate


class OtherWork:
    """Per decode batch size, the tracked seconds of a layer step's work outside attention.

    Args:
        device: where the decode runs (CUDA: timing events; otherwise the wall clock).
        warm: steps measured first at each batch size.
        every: afterwards, one step in ``every`` is measured.
        link_seconds: ``batch -> seconds`` of link time inside O per layer step (host experts read
            in place over PCIe), or None (no such reads).

    Raises:
        ValueError: ``warm`` < 0 or ``every`` < 1.
    """

    def __init__(self, device: torch.device, warm: int = 4, every: int = 16, link_seconds: Callable[[int], float] | None = None,
                 store_key: str | None = None):
        if warm < 0 or every < 1:
            raise ValueError(f"OtherWork needs warm >= 0 and every >= 1, got warm={warm}, every={every}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.warm, self.every = warm, every
        self.link_seconds = link_seconds
        self.store_key = store_key
        self._estimates: dict[int, OnlineEstimate] = {b: OnlineEstimate(v) for b, v in (stored(store_key) if store_key else {}).items()}
        self._measured = False  # since the last save
        self._steps: dict[int, int] = {}  # decode steps begun per batch size
        self._marks: list | None = None  # this step's ("b" | "e", layer, stamp), None: not measured
        self._batch = 0
        self._last_layer = None
        self._waiting: deque = deque()  # (batch, marks) of steps whose events may not have completed

    # ------------------------------------------------------------------ reading
    def seconds(self, batch: int) -> float | None:
        """The tracked O of a layer step at ``batch`` sequences, None before any step was measured
        at that size (then the gate keeps its form without O)."""
        self._resolve()
        est = self._estimates.get(batch)
        return est.value if est is not None else None

    def save(self) -> Path | None:
        """Keep the estimates for later processes (with a ``store_key``, after new measurements;
        a file that cannot be written costs only the keeping). Call it between steps (the engine does
        after ``generate``): the step under way counts as finished. Returns the file written, or None."""
        if self._marks:
            self._waiting.append((self._batch, self._marks))
        self._marks, self._last_layer = None, None
        self._resolve()
        if not (self.store_key and self._measured):
            return None
        path = store_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                doc = {}
            doc[self.store_key] = {str(b): e.value for b, e in sorted(self._estimates.items())}
            tmp = path.with_suffix(f".{id(self)}.tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(path)
        except OSError:
            return None
        self._measured = False
        return path

    def link(self, batch: int) -> float:
        """Seconds of link time inside O per layer step at ``batch`` (0 without in-place host experts)."""
        return float(self.link_seconds(batch)) if self.link_seconds is not None else 0.0

    # ------------------------------------------------------------------ marks from the decode path
    def begin(self, layer: int, batch: int) -> None:
        """A decode layer's attention begins (before its KV append); a layer at or below the last
        begun one starts a new step."""
        if self._last_layer is None or layer <= self._last_layer:
            self._new_step(batch)
        self._last_layer = layer
        if self._marks is not None:
            self._marks.append(("b", layer, self._stamp()))

    def end(self, layer: int) -> None:
        """A decode layer's attention has ended (its merge issued)."""
        if self._marks is not None:
            self._marks.append(("e", layer, self._stamp()))

    # ------------------------------------------------------------------ internals
    def _stamp(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _new_step(self, batch: int) -> None:
        if self._marks:
            self._waiting.append((self._batch, self._marks))
        self._resolve()
        n = self._steps.get(batch, 0)
        self._steps[batch] = n + 1
        self._batch = batch
        first = n == 0  # this size's graphs are captured in it
        self._marks = None if first else [] if n <= self.warm or (n - 1 - self.warm) % self.every == self.every - 1 else None

    def _resolve(self) -> None:
        """Fold in every waiting step whose last mark has completed (CUDA: ``query``, no wait)."""
        while self._waiting:
            batch, marks = self._waiting[0]
            last = marks[-1][2]
            if self.cuda and not last.query():
                return
            self._waiting.popleft()
            gaps = [self._elapsed(a[2], b[2]) for a, b in zip(marks, marks[1:])
                    if a[0] == "e" and b[0] == "b" and b[1] == a[1] + 1]
            if gaps:
                self._update(batch, statistics.median(gaps))

    def _elapsed(self, a, b) -> float:
        return b - a if not self.cuda else a.elapsed_time(b) / 1e3

    def _update(self, batch: int, sample: float) -> None:
        if not sample >= 0:  # NaN or a clock step back: no measurement
            return
        est = self._estimates.get(batch)
        if est is None:
            self._estimates[batch] = OnlineEstimate(sample, samples=deque([sample]))
        else:
            est.update(sample)
        self._measured = True


def for_engine(device: torch.device, config, dtype: torch.dtype, moe_blocks: list) -> OtherWork:
    """The engine's meter: on CUDA with a :func:`store_key` of this machine, model, expert placement
    and the kernels' switches set in the environment (their defaults otherwise); without CUDA none
    (nothing is kept)."""
    cuda = torch.device(device).type == "cuda"
    return OtherWork(device, store_key=engine_store_key(device, config, dtype, moe_blocks) if cuda else None)


def engine_store_key(device: torch.device, config, dtype: torch.dtype, moe_blocks: list) -> str:
    """:func:`store_key` of an engine: this machine, ``config``'s shape, the routed experts in host
    memory over ``moe_blocks``, and the kernels' switches set in the environment."""
    import os

    from writescope.engine.switches import NAMES
    from writescope.scheduler.calibrate import machine_key

    host = sum(len(b.host_experts) for b in moe_blocks)
    routed = sum(b.cfg.num_experts for b in moe_blocks)
    switches = ",".join(f"{n}={os.environ[n]}" for n in NAMES if os.environ.get(n))
    return store_key(machine_key(torch.device(device)), config, dtype, host, routed, switches)


def store_path() -> Path:
    return cache_dir("") / "other_work.json"


def stored(key: str) -> dict[int, float]:
    """The kept estimates of ``key`` (batch -> seconds); empty when none are kept or the file is unreadable."""
    try:
        entry = json.loads(store_path().read_text())[key]
        return {int(b): float(s) for b, s in entry.items() if float(s) >= 0}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def store_key(machine: str, config, dtype: torch.dtype, host_experts: int, routed_experts: int, switches: str) -> str:
    """What O depends on: the machine (``calibrate.machine_key``), the model's shape, the dtype,
    how many routed experts live in host memory, and the kernels' switches (``switches``)."""
    return (f"{machine}|{config.model_type} {config.num_layers} layers {config.hidden_size} hidden|{dtype}|"
            f"{host_experts}/{routed_experts} host experts|{switches}")


def in_place_link_seconds(blocks: list, seconds_per_byte: float, num_layers: int,
                          max_tokens: int | None) -> Callable[[int], float] | None:
    """``batch -> seconds`` of link time per layer step of the hit host experts that the fused decode
    kernels read in place over PCIe, or None when no block reads host experts in place for steps
    of up to ``max_tokens`` tokens.

    A block's hit host experts at ``batch`` tokens are its expected distinct hit experts
    (:func:`writescope.scheduler.expert_work.expected_host_expert_bytes`, uniform routing): their weight bytes at ``seconds_per_byte`` (the calibrated streaming
    rate) over all ``num_layers`` layers give the mean per layer step.
    """
    from writescope.scheduler.expert_work import expected_host_expert_bytes

    hosted = [b for b in blocks if b.host_experts and b.host_pack is not None and b.reads_host_experts_in_place(max_tokens)]
    if not hosted or num_layers < 1:
        return None

    def link(batch: int) -> float:
        return expected_host_expert_bytes(hosted, batch) * seconds_per_byte / num_layers

    return link
