"""O: a decode layer step's work outside attention, measured on the real decode path.

Between one layer's attention (its merge issued) and the next layer's (its KV append) the GPU runs
the layer's output projection, its experts and the next layer's norms and q/k/v projections. Two
things follow for the split gate (:func:`writescope.scheduler.roofline.split_pays`):

- Streaming alone hides its copies behind this work: the load region's blocks of layer l+1 stream
  while layer l runs its experts, and its fixed cost is issued ahead with them. So a step of
  streaming alone takes about max(O + C_gpu_alone, B_alone L) per layer, not the sum. On the H200 machine at DeepSeek-V2-Lite 4 x 8K, `gpu` attended a layer in
  0.383 ms of device time (98.7 GB/s, above the link's 54 GB/s), O was 0.67 ms, and the
  attention-only calibration line said 0.93 ms for streaming alone.
- A split's CPU part cannot hide there: it needs this layer's q. A split step takes
  max(O + max(T_cpu(r), C_gpu), T_gpu(r)) + max(C_split, SPLIT_HANDOVER) per layer (the
  hand-over between the sides, 0.15-0.28 ms a layer on the H200 in run 40), with C_gpu, the link
  side's fixed cost, at most :data:`~writescope.scheduler.roofline.LINK_FIXED` (it too hides
  behind O for the most part: runs 40-41).

Without O the gate deployed r = 0.03 at DSV2 4 x 8K and ran at 0.75x `gpu`
(benchmarks/results/evaluation_h200.md). Host experts read in place over PCIe inside O use the
link as well: their link time is added to the link's side (``link_seconds``). The share r(L)
itself balances the split step's two sides with O on the CPU's and that link time on the link's
(writescope/scheduler/roofline.py), except in steps split into micro-batches.

O is measured as the time from one layer's attention end to the next layer's attention begin within
a decode step. On CUDA that is a pair of timing events on the current stream, read once they have
completed, with no synchronisation added; without CUDA it is the wall clock. Only some steps are
measured: after the first step at each batch size, the next ``warm``, then every ``every``-th. The
first is left out because it captures that size's CUDA graphs (models/graphs.py) in its gaps, and so
is any later step that captured one (``captures``, given by the engine: a new policy or expert path
may capture stages under new keys). In run 64 (benchmarks/results/gpu_decode_h200.md) O at Qwen3
4 x 8K and 4 x 32K stood at 4.0 ms a layer after bench's warm-up, whose later policies' first steps
may capture, and came down to 2.4 over the rows' own steps; which warm-up steps captured was not
recorded. Each
measured step's median gap is one sample for its batch size, tracked as A is: an
:class:`~writescope.scheduler.roofline.OnlineEstimate`, whose median of the last three samples
keeps one slow step from moving it. Steps split into two micro-batches are not measured, since their halves interleave.

O depends on the path a layer's host experts take: computed by the CPU (the stage waits for the
expert worker, about 1.1 ms a layer at Qwen3-30B-A3B batch 4) or read by the link (in place over
PCIe inside the stage, 2.5-3 ms there). So each sample is kept under the path the step's host
experts took (:func:`expert_path`: the share the link read in its MoE passes, ``expert_link_share``,
given by the engine, read when the step's last layer begins), and the balance asks for O under the
path it expects its placement to take
(:meth:`~writescope.scheduler.expert_work.ExpertWork.expected_link_share`), else the path of the
last step at that batch, else the one the blocks' configuration expects (``expected_link_share``). With one O per batch size, bench's warm-up at 512
tokens, where ``writescope`` streamed its experts, set O at Qwen3 4 x 16K to 2.9-3.6 ms a layer
where the steps computing them on the CPU spent about 1.5-1.8 (run 63 on an H100 host,
benchmarks/results/gpu_decode_h200.md): the balance saw the CPU's side full and placed r 0.

The meter also keeps the in-step A: A as the ``writescope`` policy tracked it over real decode
steps (:attr:`writescope.scheduler.roofline.WriteScopePolicy.in_step_a`), per kernel switches and
CPU attention thread count (A depends on both). Calibration measures A faster than decode steps
see it, since it reads a few layers' data again (DeepSeek-V2-Lite on the H200: 15.9 against 17-20
ns/token), and each ``LLM.set_policy`` builds a fresh policy: one started from the kept in-step A
places its batch's prompts as the decode steps will find them. It keeps the in-step C_cpu
(:attr:`~writescope.scheduler.roofline.WriteScopePolicy.in_step_c`) too, per batch size and in
memory only: the CPU part's fixed cost as decode steps see it, learnt from parts whose calibrated
per-token time is at most their fixed cost (run 62 on an H100 host, DeepSeek-V2-Lite batch 16:
about 0.6 ms a part in the steps against 1.26 calibrated).

A batch is placed when its prompts are written, before its first decode step, so the first
``generate`` of a process would place its prompts without O and with the calibration's A. With a
``store_key`` (the engine gives one on CUDA: :func:`store_key`), O and the in-step A are kept in
``$XDG_CACHE_HOME/writescope/other_work.json`` (:meth:`OtherWork.save`), and a later process of
the same machine, model shape, expert placement and kernels starts from them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from writescope.engine.timing import stamp, stamp_seconds
from writescope.paths import cache_dir
from writescope.scheduler.expert_path import expert_path, path_signature
from writescope.scheduler.roofline import OnlineEstimate


class OtherWork:
    """Per decode batch size, the tracked seconds of a layer step's work outside attention; and
    per CPU attention thread count, the in-step A kept from ``writescope`` policies.

    Args:
        device: where the decode runs (CUDA: timing events; otherwise the wall clock).
        warm: steps measured first at each batch size.
        every: afterwards, one step in ``every`` is measured.
        link_seconds: ``batch -> seconds`` of link time inside O per layer step (host experts read
            in place over PCIe), or None (no such reads).
        store_key: the entry of the store file the estimates start from and are saved to
            (:func:`store_key`); None: kept in memory only.
        expert_link_share: ``() -> share`` of the hit host experts the link read in the last MoE pass
            issued (None: no host experts), read at the begin of each step's last layer to key its
            O by :func:`expert_path`; None: one path for every step.
        captures: ``() ->`` CUDA graphs captured so far by the decode step: a step during which it
            grew is not measured; None: only each batch size's first step is left out.

    Raises:
        ValueError: ``warm`` < 0 or ``every`` < 1.
    """

    def __init__(self, device: torch.device, warm: int = 4, every: int = 16, link_seconds: Callable[[int], float] | None = None,
                 store_key: str | None = None, expert_link_share: Callable[[], float | None] | None = None,
                 captures: Callable[[], int] | None = None):
        if warm < 0 or every < 1:
            raise ValueError(f"OtherWork needs warm >= 0 and every >= 1, got warm={warm}, every={every}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.warm, self.every = warm, every
        self.link_seconds = link_seconds
        self.store_key = store_key
        self.expert_link_share = expert_link_share
        self.captures = captures
        self._captures_at_start = 0  # captures() when the step under way began
        self._last_path: dict[tuple[str, int], str] = {}  # (switches, batch) -> the expert path of its last step
        self._top_layer = -1  # the highest layer a step has begun: the share is read at its begin (_note_share)
        self._step_share: tuple[bool, float | None] = (False, None)  # (read in this step, the share read)
        # batch -> the expected share of the link, for the path of a batch size no step has run at yet (the engine's)
        self.expected_link_share: Callable[[int], float | None] | None = None
        # (switches, batch) -> estimate: a bench row's own switches (POLICY@NAME=VALUE) run other kernels
        self._estimates: dict[tuple[str, int], OnlineEstimate] = {k: OnlineEstimate(v) for k, v in stored(store_key).items()} if store_key else {}
        self._new: set[tuple[str, int]] = set()  # measured since the last save
        # (switches, CPU attention threads) -> the in-step A, seconds per token
        self._a: dict[tuple[str, int], float] = stored(store_key, IN_STEP_A) if store_key else {}
        self._new_a: set[tuple[str, int]] = set()  # kept since the last save
        # (switches, CPU attention threads, batch) -> the in-step C_cpu, seconds per CPU part (this process only)
        self._c: dict[tuple[str, int, int], float] = {}
        self._steps: dict[tuple[str, int], int] = {}  # decode steps begun per (switches, batch)
        self._marks: list | None = None  # this step's ("b" | "e", layer, stamp), None: not measured
        self._step_key: tuple[str, int] = ("", 0)
        self._last_layer = None
        self._waiting: deque = deque()  # (key, marks) of steps whose events may not have completed
        self._paused = False  # inside paused(): nothing measured or kept

    # ------------------------------------------------------------------ reading
    def seconds(self, batch: int, path: str | None = None) -> float | None:
        """The tracked O of a layer step at ``batch`` sequences under the switches set now with the
        host experts on ``path`` (:func:`expert_path`; None: the path of the last step at
        ``batch``, else the one :attr:`expected_link_share` expects there), None before any such step
        was measured (then the gate keeps its form without O)."""
        self._resolve()
        sig = switch_signature()
        if path is None:
            path = self._last_path.get((sig, batch))
        if path is None:
            path = expert_path(self.expected_link_share(batch)) if self.expected_link_share is not None else ""
        est = self._estimates.get((path_signature(sig, path), batch))
        return est.value if est is not None else None

    def path(self, batch: int) -> str:
        """The expert path (:func:`expert_path`) of the last step at ``batch`` under the switches set now ("" before one)."""
        return self._last_path.get((switch_signature(), batch), "")

    def in_step_a(self, threads: int) -> float | None:
        """The in-step A (seconds per token) kept for ``threads`` CPU attention threads under the
        switches set now, None where none was kept (then a policy starts from calibration)."""
        return self._a.get((switch_signature(), threads))

    def keep_in_step_a(self, threads: int, seconds_per_token: float | None) -> None:
        """Keep A as a policy tracked it over real decode steps with ``threads`` CPU attention
        threads, under the switches set now, for the policies made after it (and, with a
        ``store_key``, for later processes: :meth:`save`). None, or a value that is not finite and
        positive, keeps nothing; nor does anything inside :meth:`paused`."""
        if self._paused or seconds_per_token is None or not (math.isfinite(seconds_per_token) and seconds_per_token > 0):
            return
        key = (switch_signature(), threads)
        self._a[key] = float(seconds_per_token)
        self._new_a.add(key)

    def in_step_c(self, threads: int, batch: int) -> float | None:
        """The in-step C_cpu (seconds per CPU part of a layer step) kept for ``threads`` CPU
        attention threads at ``batch`` sequences under the switches set now, None where none was
        kept (then a policy starts from the calibration's)."""
        return self._c.get((switch_signature(), threads, batch))

    def keep_in_step_c(self, threads: int, batch: int, seconds: float | None) -> None:
        """Keep C_cpu as a policy tracked it over real decode steps at ``batch`` sequences
        (:attr:`~writescope.scheduler.roofline.WriteScopePolicy.in_step_c`), for the policies made
        after it in this process (not on disk: a fixed cost per part is kept per batch size, and
        the store's sections are per thread count). None, a value that is not (finite and >= 0),
        or anything inside :meth:`paused` keeps nothing."""
        if self._paused or seconds is None or not (math.isfinite(seconds) and seconds >= 0):
            return
        self._c[switch_signature(), threads, batch] = float(seconds)

    def forget_in_step_c(self) -> None:
        """Drop every kept C_cpu (bench does after its warm-up, whose first steps capture graphs)."""
        self._c.clear()

    def save(self) -> Path | None:
        """Keep the estimates measured in this process (O and the in-step A) for later ones (with a
        ``store_key``): under a lock, the file is read again and only what was measured here
        replaces its entries. A file that cannot be read or written costs only the keeping. Call it
        between steps (the engine does after ``generate``): the step under way counts as finished.
        Returns the file written, or None."""
        self._end_step()
        self._marks, self._last_layer = None, None
        self._resolve()
        if not (self.store_key and (self._new or self._new_a)):
            return None
        path = store_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(path.with_suffix(".lock")):
                try:
                    doc = json.loads(path.read_text())
                except (OSError, ValueError):
                    doc = {}
                if not isinstance(doc, dict):
                    doc = {}
                entry = doc.get(self.store_key)
                entry = entry if isinstance(entry, dict) else {}
                for sig, batch in sorted(self._new):
                    by_batch = entry.get(sig)
                    by_batch = by_batch if isinstance(by_batch, dict) else {}
                    by_batch[str(batch)] = self._estimates[sig, batch].value
                    entry[sig] = by_batch
                if self._new_a:
                    section = entry.get(IN_STEP_A)
                    section = section if isinstance(section, dict) else {}
                    for sig, threads in sorted(self._new_a):
                        by_threads = section.get(sig)
                        by_threads = by_threads if isinstance(by_threads, dict) else {}
                        by_threads[str(threads)] = self._a[sig, threads]
                        section[sig] = by_threads
                    entry[IN_STEP_A] = section
                doc[self.store_key] = entry
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
                try:
                    with os.fdopen(fd, "w") as f:
                        f.write(json.dumps(doc, indent=1))  # our own values are finite (_update); others pass as they are
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
        except (OSError, ValueError):
            return None
        self._new.clear()
        self._new_a.clear()
        return path

    def link(self, batch: int) -> float:
        """Seconds of link time inside O per layer step at ``batch`` (0 without in-place host experts)."""
        return float(self.link_seconds(batch)) if self.link_seconds is not None else 0.0

    @contextmanager
    def paused(self):
        """Measure nothing and keep no A inside the block: steps run under a profiler are slower
        than the real path (``writescope profile``), and what they measured would place the KV of
        later batches, in this process and, kept on disk, in later ones. The step under way when it
        starts is dropped, not measured."""
        before, self._paused = self._paused, True
        self._marks, self._last_layer = None, None
        try:
            yield
        finally:
            self._paused = before
            self._marks, self._last_layer = None, None

    # ------------------------------------------------------------------ marks from the decode path
    def begin(self, layer: int, batch: int) -> None:
        """A decode layer's attention begins (before its KV append); a layer at or below the last
        begun one starts a new step."""
        if self._paused:
            return
        if self._last_layer is None or layer <= self._last_layer:
            self._new_step((switch_signature(), batch))
        self._last_layer = layer
        if layer >= self._top_layer and layer > 0:  # the step's last layer: its other layers' MoE passes are issued
            self._top_layer = layer
            self._note_share()
        if self._marks is not None:
            self._marks.append(("b", layer, self._stamp()))

    def end(self, layer: int) -> None:
        """A decode layer's attention has ended (its merge issued)."""
        if self._marks is not None and not self._paused:
            self._marks.append(("e", layer, self._stamp()))

    # ------------------------------------------------------------------ internals
    def _stamp(self):
        return stamp(self.device)

    def _end_step(self) -> None:
        """The step under way has ended (a new one begins, or a save): its path noted, its marks
        queued under it."""
        if self._last_layer is None:  # none under way
            return
        read, share = self._step_share
        if not read:  # a step shorter than the longest seen (or the first): read now
            self._note_share()
            share = self._step_share[1]
        path = expert_path(share)
        self._step_share = (False, None)
        sig, batch = self._step_key
        self._last_path[sig, batch] = path
        if self._marks and not (self.captures is not None and self.captures() != self._captures_at_start):
            self._waiting.append(((path_signature(sig, path), batch), self._marks))

    def _note_share(self) -> None:
        """Read the link's share of the host experts for the step under way. Read at its last
        layer's begin, not when the next step begins: a prefill chunk issued between two decode
        steps (the online engine) would set the blocks' shares first."""
        self._step_share = (True, self.expert_link_share() if self.expert_link_share is not None else None)

    def _new_step(self, key: tuple[str, int]) -> None:
        self._end_step()
        self._step_share = (False, None)  # (also after a step dropped by paused())
        self._resolve()
        n = self._steps.get(key, 0)
        self._steps[key] = n + 1
        self._step_key = key
        first = n == 0  # this size's graphs are captured in it
        self._marks = None if first else [] if n <= self.warm or (n - 1 - self.warm) % self.every == self.every - 1 else None
        if self._marks is not None and self.captures is not None:
            self._captures_at_start = self.captures()

    def _resolve(self) -> None:
        """Fold in every waiting step whose last mark has completed (CUDA: ``query``, no wait)."""
        while self._waiting:
            key, marks = self._waiting[0]
            last = marks[-1][2]
            if self.cuda and not last.query():
                return
            self._waiting.popleft()
            gaps = [stamp_seconds(a[2], b[2]) for a, b in zip(marks, marks[1:])
                    if a[0] == "e" and b[0] == "b" and b[1] == a[1] + 1]
            if gaps:
                self._update(key, statistics.median(gaps))

    def _update(self, key: tuple[str, int], sample: float) -> None:
        if not (math.isfinite(sample) and sample >= 0):  # NaN, infinite or a clock step back: no measurement
            return
        est = self._estimates.get(key)
        if est is None:
            self._estimates[key] = OnlineEstimate(sample, samples=deque([sample]))
        else:
            est.update(sample)
        self._new.add(key)


_SWITCH_NAMES: tuple[str, ...] | None = None


def blocks_expected_share(blocks: list) -> Callable[[int], float | None]:
    """``batch ->`` the mean, over those of ``blocks`` that hold host experts, of the share the link
    is expected to read of them in a decode pass of ``batch`` tokens as each is configured: 1 read
    in place, the fixed ``stream_share`` otherwise (0 with no streaming slots); a per-step split
    attached (``expert_work``) chooses step by step, and is left to the policy's own expectation.
    None without host experts."""

    def share(batch: int) -> float | None:
        shares = []
        for b in blocks:
            if not b.host_experts:
                continue
            if b.reads_host_experts_in_place(batch):
                shares.append(1.0)
            else:
                shares.append(0.0 if b.stream_min_tokens is None else min(1.0, b.stream_share))
        return sum(shares) / len(shares) if shares else None

    return share


def blocks_link_share(blocks: list) -> Callable[[], float | None]:
    """``() ->`` the mean, over those of ``blocks`` (MoE blocks) that hold host experts now, of the
    share the link read in each one's last pass (``SparseMoeBlock.link_share_last``); None where no
    block holds host experts or none has run a pass with them."""

    def share() -> float | None:
        seen = [b.link_share_last for b in blocks if b.host_experts and b.link_share_last is not None]
        return sum(seen) / len(seen) if seen else None

    return share


def switch_signature() -> str:
    """The kernels' switches set in the environment now (``writescope.engine.switches.NAMES``),
    ``NAME=VALUE`` joined by commas; empty with every default."""
    global _SWITCH_NAMES
    if _SWITCH_NAMES is None:
        from writescope.engine.switches import MODEL_ONLY, NAMES

        _SWITCH_NAMES = tuple(n for n in NAMES if n not in MODEL_ONLY)  # not those that steer only the placement's model
    return ",".join(f"{n}={os.environ[n]}" for n in _SWITCH_NAMES if os.environ.get(n))


@contextmanager
def _locked(path: Path):
    """An exclusive ``flock`` on ``path`` for the block (none where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def for_engine(device: torch.device, config, dtype: torch.dtype, moe_blocks: list) -> OtherWork:
    """The engine's meter: on CUDA with the :func:`engine_store_key` of this machine, model and
    expert placement (estimates kept per kernel switches and expert path within it); without CUDA
    nothing is kept. Its steps' expert path is read from ``moe_blocks`` (:func:`blocks_link_share`)."""
    cuda = torch.device(device).type == "cuda"
    meter = OtherWork(device, store_key=engine_store_key(device, config, dtype, moe_blocks) if cuda else None,
                      expert_link_share=blocks_link_share(moe_blocks))
    meter.expected_link_share = blocks_expected_share(moe_blocks)
    return meter


def engine_store_key(device: torch.device, config, dtype: torch.dtype, moe_blocks: list) -> str:
    """:func:`store_key` of an engine: this machine, ``config``, the dtype and the routed experts in
    host memory over ``moe_blocks``."""
    from writescope.scheduler.calibrate import machine_key

    host = sum(len(b.host_experts) for b in moe_blocks)
    routed = sum(b.cfg.num_experts for b in moe_blocks)
    return store_key(machine_key(torch.device(device)), config, dtype, host, routed)


def store_path() -> Path:
    return cache_dir("") / "other_work.json"


# the section of a store entry holding the in-step A: {switches: {CPU attention threads: seconds per token}},
# beside O's {switches: {batch: seconds}} (never a switch signature, which is empty or NAME=VALUE pairs)
IN_STEP_A = "in_step_a"


def stored(key: str, section: str | None = None) -> dict[tuple[str, int], float]:
    """The kept estimates of ``key``: with ``section`` None, O as (switches, batch) -> seconds; with
    :data:`IN_STEP_A`, the in-step A as (switches, CPU attention threads) -> seconds per token.
    Entries that are not a positive count with a finite time (non-negative for O, positive for A)
    are left out one by one; an unreadable file keeps nothing."""
    try:
        entry = json.loads(store_path().read_text()).get(key)
        entry = entry if section is None else entry.get(section)
    except (OSError, ValueError, AttributeError):
        return {}
    out = {}
    for sig, by_count in (entry.items() if isinstance(entry, dict) else ()):
        if section is None and sig == IN_STEP_A:
            continue
        for n, v in (by_count.items() if isinstance(by_count, dict) else ()):
            try:
                count, secs = int(n), float(v)
            except (TypeError, ValueError):
                continue
            if count > 0 and math.isfinite(secs) and (secs > 0 if section is not None else secs >= 0):
                out[str(sig), count] = secs
    return out


# part of the key: a change in how O is measured starts afresh (the in-step A is an added section). 2: O kept
# per expert path, the experts' sum read in place (the old entries mixed paths, measured with the sum copied)
STORE_VERSION = 2


def store_key(machine: str, config, dtype: torch.dtype, host_experts: int, routed_experts: int) -> str:
    """What O depends on beyond the kernels' switches: the machine (``calibrate.machine_key``), the
    model (a hash of its whole configuration), the dtype and how many routed experts live in host
    memory; with the store's version."""
    model = hashlib.sha1(config.hf_config_json.encode()).hexdigest()[:12]
    return (f"v{STORE_VERSION}|{machine}|{config.model_type} {config.num_layers} layers, config {model}|{dtype}|"
            f"{host_experts}/{routed_experts} host experts")


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
