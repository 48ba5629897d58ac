"""The roofline CPU share r(L) and the online estimate of A (paper section 5, docs/DESIGN.md section 5).

With A = CPU seconds per placed token, B = GPU load seconds per token, C_cpu / C_gpu the fixed
per-step costs of each side, a step over L placed tokens takes

    T_cpu(r) = r A L + C_cpu,     T_gpu(r) = (1 - r) B L + C_gpu,

and the two sides finish together at

    r(L) = clamp( B / (A + B) + (C_gpu - C_cpu) / ((A + B) L), 0, 1 )     (paper eq. 2).

A is re-estimated from the measured CPU parts of decode steps large enough for it (it drifts with
concurrent requests and CPU experts), and C_cpu from the small ones, per batch size
(:meth:`WriteScopePolicy.observe`); B and C_gpu come from calibration.

Beyond the paper, a split must pay: streaming alone runs at its own, uncontended rate (B_alone,
C_gpu_alone; host memory bandwidth is not shared with CPU reads then), and a split step may cost
C_split beyond its slower side. Where max(T_cpu(r), T_gpu(r)) + C_split >= B_alone L + C_gpu_alone,
the share is 0 (:func:`split_pays`). Where the layer step's work outside attention (O) has been
measured, the gate compares the two with it: streaming alone hides behind O, its fixed cost
C_gpu_alone included, the CPU part does not, and a split pays a hand-over of at least
SPLIT_HANDOVER (writescope/scheduler/other_work.py). Why the fixed cost hides and the hand-over
counts: in run 40 on the H200 (benchmarks/results/gpu_decode_h200.md) the `gpu` rows' attention per
layer matched B_alone L + O_link within 0.1 ms at DeepSeek-V2-Lite 4-16 x 8K-32K and Qwen3-30B-A3B
4 x 8K-32K, 0.2-0.37 ms under the form with C_gpu_alone, and a split step's hand-over took 0.15-0.28
ms; the old gate split DeepSeek-V2-Lite 4 x 16K (r 0.45, 47.7 ms a step) where streaming alone took
45.0. Why: in the first H200 whole-model decode grid
(benchmarks/results/e2e.md), whose step waited on the host between the halves, streaming alone
beat every measured split. Calibration leaves C_split at 0: its attention-only loop's hand-over
(1.7-2.4 ms a layer) is not a whole step's (writescope/scheduler/calibrate.py says how that was
measured); the gate with O charges the whole step's measured hand-over, SPLIT_HANDOVER, instead,
and a roofline given by hand may set a larger C_split.

Also beyond the paper, the balance counts O. The CPU part needs the layer's q, so per layer the
CPU side takes O + T_cpu(r), while the link streams the next layer's blocks during O and takes
T_gpu(r) + O_link (O_link: the link time of host experts read in place inside O). Both finish
together at eq. 2 with C_cpu + O and C_link + O_link for the fixed costs:

    r(L) = roofline_share(L, A, B, C_cpu + O, C_link + O_link),    C_link = min(C_gpu, LINK_FIXED).

C_link is the link side's fixed cost inside a whole-model step. Calibration's C_gpu is that of a
synchronised attention-only loop (0.52-0.55 ms a layer for DeepSeek-V2-Lite on the H200); inside a
step most of it hides behind O, as streaming alone's does: run 40's four link-bound static rows at
batch 16 put the link side's fixed cost (from O's start, less T_gpu at B and O_link) at 0.22 +- 0.03
ms, run 41's at batch 4 lower, about 0.10 ms
(benchmarks/results/grid_deepseek-v2-lite_h200_run40_b16.json, grid_deepseek-v2-lite_h200_run41_b4.json).
With C_gpu in full, r ran high where O was measured (run 41, 4 x 32K: deployed 0.539 / 0.523, the
static rows' optimum about 1/3) and the gate refused a split that ran 4-7% faster (4 x 16K:
`static:1/3` 42.9 / 41.8 ms a step against streaming alone's 44.8); with :data:`LINK_FIXED` the
replay of run 41's placements gives 0 at 4 x 8K (streaming alone won there), 0.25 / 0.32 at 4 x 16K
and 0.46 / 0.45 at 4 x 32K, and at batch 16 (run 40) about 0.33 / 0.41-0.43 / 0.50-0.51 at 8K /
16K / 32K, at or near the measured crossings. The gate with O charges C_link in the same place
(:func:`split_pays` gets the capped roofline). Where O is not measured, and in micro-batched
steps, C_gpu stands.

The link works ahead during O only as far as the ping-pong buffers reach: the copies of the next
layer's blocks wait for a free buffer, and two buffers of 64 MiB hold about 2.4 ms of the link's
time on the H200, where O is 1 ms (DeepSeek-V2-Lite), 8.6 ms (Qwen3-30B-A3B) or 16 ms (Mixtral-8x7B).
So the link's side counts max(O_link, O - W), W the link time of the buffers' tokens
(:attr:`WriteScopePolicy.prefetch_tokens`; none when the load region is read in place). Without the
cap the balance gave the CPU side O uncovered by the link: on the H200, Qwen3-30B-A3B 16 x 32K with
the host-expert split (O_link 0) deployed r = 0.35 and took 1,192 ms a step, where fixed shares of
0.5 and 0.6 took 880 and 844 ms (run 36, benchmarks/results/gpu_decode_h200.md), and Mixtral-8x7B
4 x 32000 deployed r = 0.

Without O the CPU side was the step's critical path (DeepSeek-V2-Lite 16 x 32K on the H200: r =
0.531 deployed, the CPU part 5.3-6.1 ms per layer against 3.0 ms for the GPU part; the balance
with O = 1.0 ms and the A of those decode steps gives 0.43-0.45). Where O is not measured yet,
eq. 2 stands alone. Steps split into two micro-batches (``WRITESCOPE_MICRO_BATCHES=2``, or ``auto``
in steps whose CPU computes no host experts: scheduler/placement.py ``micro_batched``) keep eq. 2
without O: there the CPU attends one half while the GPU runs the other half's O. With a per-step
split of host experts (scheduler/joint.py) the joint roofline sets r and O is not used.

A is measured faster by calibration (a few layers' data read again: 15.9 ns/token for
DeepSeek-V2-Lite on the H200) than inside real decode steps (17-20 ns/token), and a batch's prompt
KV is placed before its first decode step and never moves. So the A a policy tracked over real
decode steps (:attr:`WriteScopePolicy.in_step_a`) is kept by the engine's meter of O, in memory and
on CUDA on disk, per kernel switches and CPU attention thread count
(:meth:`~writescope.scheduler.other_work.OtherWork.keep_in_step_a`), and a later policy starts its
estimate from it (:meth:`WriteScopePolicy.attach`) instead of from calibration.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from writescope.env import env_float
from writescope.kvcache.spec import Roofline
from writescope.scheduler.expert_path import expert_path
from writescope.scheduler.joint import joint_split
from writescope.scheduler.placement import PlacementPolicy, micro_batched

A_FLOOR = 0.1  # A is never estimated below this fraction of its calibrated value
# A CPU part whose calibrated fixed cost C_cpu is more than this share of its calibrated time gives no sample
# of A (WriteScopePolicy.observe). Inside real steps a part's fixed cost is not quite C_cpu, and the
# difference is divided by the part's tokens: on the H200 the bench's warm-up at 512 tokens (CPU
# parts of 2-4K tokens, about 0.5 ms against C_cpu 0.3 ms) taught A = 43 ns/token for Qwen3-30B-A3B
# and about 200 for Mixtral-8x7B (calibration: 23.6 and 54), and the first 32K row, starting from
# that kept A, placed r = 0.41 and 0.21 instead of 0.53 and 0.44 (run 37,
# benchmarks/results/gpu_decode_h200.md). At a quarter, an error of the fixed part costs the
# sample at most a third of that error's share of C_cpu.
MAX_FIXED_SHARE = 0.25
# C_cpu is learnt only from parts whose calibrated per-token time is at most their calibrated fixed
# cost (WriteScopePolicy.observe): each sample (time - A tokens) takes in A's error times the tokens,
# so this bounds that error's share of C_cpu by A's relative error; parts between this and
# MAX_FIXED_SHARE teach neither. And the learnt C_cpu stays within these multiples of the calibrated.
C_BAND = 0.5
C_RANGE = (0.25, 2.0)
# The hand-over a split step pays beyond its slower side inside a whole-model decode step (q to the
# CPU, its partial back, the merge), which the gate with O counts where the roofline's C_split is
# smaller: run 40 on the H200 measured 0.15-0.21 ms per layer at DeepSeek-V2-Lite batch 4 (0.16-0.28
# at batch 16, 0.10-0.19 Qwen3-30B-A3B), benchmarks/results/gpu_decode_h200.md.
SPLIT_HANDOVER = 0.15e-3
# The link (streamed) side's fixed cost per layer inside a whole-model decode step, charged instead of
# a larger calibrated C_gpu by the balance and the gate where O is measured and the step is not split
# into micro-batches (WriteScopePolicy.cpu_share; the module docstring says why). Calibration's C_gpu
# (0.52-0.55 ms for DeepSeek-V2-Lite on the H200) is a synchronised attention-only loop's; inside a
# step most of it hides behind O. Run 40's four link-bound DeepSeek-V2-Lite static rows at batch 16
# put it at 0.22 +- 0.03 ms (grid_deepseek-v2-lite_h200_run40_b16.json), lower at batch 4; the
# replay of run 41 (grid_deepseek-v2-lite_h200_run41_b4.json) with 0.15 ms moved r toward the
# measured optimum in every cell (4 x 32K 0.54 -> 0.46, static optimum about 1/3; 4 x 16K from 0 to
# 0.25-0.32, where `static:1/3` ran 4-7% faster than streaming alone) and made none worse.
LINK_FIXED = 0.15e-3
LINK_FIXED_ENV = "WRITESCOPE_LINK_FIXED"


def link_fixed_from_env() -> float | None:
    """``WRITESCOPE_LINK_FIXED``: the link side's fixed cost per layer inside a whole-model decode
    step, in milliseconds (a float >= 0), charged in the balance and on both sides of the gate
    (streaming alone pays it too) instead of min(C_gpu, :data:`LINK_FIXED`) on the split side only.
    Unset or empty: None (that default). An A/B switch for the rows that measure the link's idle
    time at layer boundaries (benchmarks/results/gpu_decode_h200.md, run 63).

    Raises:
        ValueError: not a number, negative, NaN or infinite (names the value).
    """
    ms = env_float(LINK_FIXED_ENV, 0.0, f"use milliseconds, a number >= 0 such as 0.4 (unset: min(C_gpu, "
                                        f"{LINK_FIXED * 1e3:g} ms) on the split side only)")
    return None if ms is None else ms * 1e-3


def roofline_share(L: float, a: float, b: float, c_cpu: float = 0.0, c_gpu: float = 0.0) -> float:
    """r(L) of paper eq. 2, clamped to [0, 1].

    Args:
        L: placed tokens (>= 0; for a batch, the tokens all its sequences place).
        a, b: seconds per token of the CPU and of the load path (>= 0).
        c_cpu, c_gpu: fixed seconds per step of each side.

    Degenerate inputs do not divide by zero: with A + B = 0 the share follows the sign of
    delta = C_gpu - C_cpu (0.5 when delta = 0); with L = 0 the delta term dominates (1 if
    delta > 0, 0 if delta < 0, B / (A + B) if delta = 0).

    Raises:
        ValueError: a negative or NaN A, B or L.
    """
    for name, x in (("L", L), ("A", a), ("B", b)):
        if not x >= 0:  # also NaN
            raise ValueError(f"roofline input {name} must be >= 0, got {x}")
    delta = c_gpu - c_cpu
    if a + b <= 0:
        return 1.0 if delta > 0 else 0.0 if delta < 0 else 0.5
    base = b / (a + b)
    if L == 0:
        return 1.0 if delta > 0 else 0.0 if delta < 0 else base
    return min(1.0, max(0.0, base + delta / ((a + b) * L)))


def link_in_other(other: float, other_link: float, prefetch_tokens: float | None, b: float) -> float:
    """The link's time inside O that the next layer's blocks cannot use (seconds): the host
    experts' ``other_link``, or all of O but the ``prefetch_tokens`` the ping-pong buffers hold at
    ``b`` seconds per token, whichever is more (see the module docstring). ``prefetch_tokens``
    None: no cap (the link streams ahead through all of O)."""
    if prefetch_tokens is None:
        return other_link
    return max(other_link, other - prefetch_tokens * b)


def split_pays(L: float, r: float, a: float, roofline: Roofline, other: float | None = None, other_link: float = 0.0,
               prefetch_tokens: float | None = None, alone_link_fixed: float = 0.0) -> bool:
    """Whether a step over ``L`` placed tokens with CPU share ``r`` in (0, 1] is predicted faster
    than streaming all of them with no CPU part (see the module docstring). True when the
    roofline has no stand-alone calibration (``b_alone`` None): the paper's r(L) then stands.
    ``a`` is the current estimate of A (seconds per token).

    ``other`` is O, the layer step's measured work outside attention, in seconds
    (:mod:`writescope.scheduler.other_work`); ``other_link`` is the part of O that uses the link
    (host experts read in place). Streaming alone hides behind O what the link is not busy with
    there, and its fixed cost too (launches issued ahead while the link streams):
    max(O + C_gpu_alone, B_alone L + O_link). The CPU part waits for q and does not hide:
    max(O + max(T_cpu(r), C_gpu), T_gpu(r) + O_link) + max(C_split, SPLIT_HANDOVER). With O None
    (not measured) the forms without it. C_gpu is the ``roofline``'s: :class:`WriteScopePolicy`
    passes one whose C_gpu is capped at :data:`LINK_FIXED` where O is measured and the step is not
    micro-batched (the link side's fixed cost inside a whole-model step, runs 40-41).
    ``prefetch_tokens``: what the ping-pong buffers let the link stream ahead during O
    (:func:`link_in_other`, each path at its own rate); None: no cap. ``alone_link_fixed``: the
    link's fixed seconds per layer that streaming alone pays too, on its link term (with O only;
    ``WRITESCOPE_LINK_FIXED``).
    """
    rf = roofline
    if rf.b_alone is None or r <= 0:
        return True
    t_cpu, t_gpu = r * a * L + rf.c_cpu, (1 - r) * rf.b * L + rf.c_gpu  # at r = 1 the GPU still attends the D-window (C_gpu)
    c_alone = rf.c_gpu_alone or 0.0
    if other is not None:
        split = (max(other + max(t_cpu, rf.c_gpu), t_gpu + link_in_other(other, other_link, prefetch_tokens, rf.b))
                 + max(rf.c_split, SPLIT_HANDOVER))
        alone = max(other + c_alone, rf.b_alone * L + alone_link_fixed
                    + link_in_other(other, other_link, prefetch_tokens, rf.b_alone))
    else:
        split, alone = max(t_cpu, t_gpu) + rf.c_split, rf.b_alone * L + c_alone
    return split < alone


@dataclass
class OnlineEstimate:
    """An exponentially weighted mean of the median of the last ``window`` samples.

    The median guards against outliers: one sample far off (a page fault, a preempted thread)
    does not move the median of 3, so it moves the estimate not at all; a lasting change moves
    the median after ``window // 2 + 1`` samples, and the estimate then closes a fraction
    ``alpha`` of the remaining gap per sample: within 5% of a step change after
    ``window // 2 + ceil(log(0.05) / log(1 - alpha))`` samples (10 for the defaults).
    """

    value: float
    alpha: float = 0.3
    window: int = 3
    samples: deque = field(default_factory=deque, repr=False)

    def update(self, sample: float) -> float:
        if not math.isfinite(sample) or sample < 0:
            return self.value  # not a measurement
        self.samples.append(sample)
        while len(self.samples) > self.window:
            self.samples.popleft()
        med = sorted(self.samples)[len(self.samples) // 2]
        self.value += self.alpha * (med - self.value)
        return self.value


class WriteScopePolicy(PlacementPolicy):
    """``writescope``: r(L) from the roofline with A and C_cpu tracked online.

    Args:
        roofline: calibrated A, B, C_cpu, C_gpu (seconds per token, seconds per step).
        alpha, window: see :class:`OnlineEstimate`.

    ``cpu_share(L)`` takes L per sequence and uses ``L * batch`` tokens in the delta term, with
    ``batch`` the batch size of the last observed step, or the one announced by
    :meth:`expect_batch` before a prefill (fixed costs are per step, shared by the batch).
    """

    name = "writescope"

    def __init__(self, roofline: Roofline, alpha: float = 0.3, window: int = 3):
        self.roofline = roofline
        self.a = OnlineEstimate(roofline.a, alpha, window)
        # C_cpu as decode steps see it, learnt from small CPU parts (observe), per batch size: the one
        # kept for it by the engine's meter, else the calibration's, until this policy's parts teach it
        self.c = OnlineEstimate(roofline.c_cpu, alpha, window)
        self._c_batch = None  # the batch size self.c tracks
        self._threads = None  # CPU attention threads (attach), the meter's key for the kept C_cpu
        self.batch = 1
        # O, the layer step's measured work outside attention (scheduler/other_work.py), given by the
        # engine (attach); None: the gate and the balance without it
        self.other = None
        # the cache's WRITESCOPE_MICRO_BATCHES (1, 2 or "auto"), given with O
        self.micro_batches: int | str = 1
        # with micro_batches auto: the cache's cpu_experts_from (the engine sets both; None: no step computes experts on the CPU)
        self.cpu_experts_from = None
        # tokens of one layer the cache's ping-pong buffers hold: how far the link streams ahead
        # during O (link_in_other); None: not known, no cap
        self.prefetch_tokens = None
        # the expert side of the joint roofline (scheduler/expert_work.py), attached by the engine
        # when routed experts live in host memory and the step may split them; None: KV only
        self.experts = None

    def attach(self, other, attention_threads: int, micro_batches: int | str, prefetch_tokens: int | None = None) -> None:
        """Give the policy the engine's meter of O (an
        :class:`~writescope.scheduler.other_work.OtherWork`): O enters the split gate, and the
        balance of decode steps not split into micro-batches (``micro_batches``: the cache's
        ``WRITESCOPE_MICRO_BATCHES``), the link's side capped by ``prefetch_tokens`` (the cache's
        :attr:`~writescope.kvcache.inplace.InplaceKVCache.prefetch_tokens`; None: no cap). A
        starts from the in-step A the meter kept for ``attention_threads`` CPU attention threads
        under the switches set now, where it kept one (else from the calibration's); C_cpu, at each
        batch size, from the one it kept there (else the calibration's)."""
        if prefetch_tokens is not None and not prefetch_tokens >= 0:
            raise ValueError(f"prefetch_tokens must be >= 0 or None, got {prefetch_tokens}")
        self.other, self.micro_batches, self.prefetch_tokens = other, micro_batches, prefetch_tokens
        kept = other.in_step_a(attention_threads)
        if kept is not None:
            self.a = OnlineEstimate(kept, self.a.alpha, self.a.window)
        self._threads, self._c_batch = attention_threads, None
        self._track_c(self.batch)

    @property
    def in_step_a(self) -> float | None:
        """The tracked A (seconds per token) once a decode step's CPU part gave a sample
        (:meth:`observe`); None before (the estimate is still where it started, not an in-step
        measurement)."""
        return self.a.value if self.a.samples else None

    @property
    def in_step_c(self) -> float | None:
        """The tracked C_cpu (seconds per CPU part) at the batch size of the last observed step, once
        one of its CPU parts small enough gave a sample (:meth:`observe`); None before."""
        return self.c.value if self.c.samples else None

    def cpu_share(self, placed_tokens: int) -> float:
        """r(L) for L = ``placed_tokens`` per sequence: the paper's eq. 2, with O on the CPU side
        and the link's part of O on the link's (:func:`link_in_other`: O_link, or O less what the
        ping-pong buffers let it stream ahead) where O was measured (see the module docstring), or with host
        experts the joint roofline (scheduler/joint.py) given the expected hit host expert bytes
        per step. Where O was measured and the step is not micro-batched, the link side's fixed cost
        is min(C_gpu, :data:`LINK_FIXED`) in both the balance and the gate:

            r = roofline_share(L, A, B, C_cpu + O, min(C_gpu, LINK_FIXED) + link_in_other(O, O_link, W, B)).

        ``WRITESCOPE_LINK_FIXED`` (:func:`link_fixed_from_env`) replaces min(C_gpu, LINK_FIXED) there,
        and the gate charges it to streaming alone as well; it has no effect without O or in
        micro-batched steps.

        O is the meter's under the expert path this placement is expected to take, where a
        per-step expert split is attached (:meth:`ExpertWork.expected_link_share
        <writescope.scheduler.expert_work.ExpertWork.expected_link_share>` at r 0: the CPU computes
        the host experts while the link is busy with the KV), else under the last step's path
        (scheduler/other_work.py, ``expert_path``).

        C_cpu is the tracked one (:meth:`observe`: the calibration's until a small CPU part
        teaches it). ``self.roofline`` itself is not changed (calibration reports and
        :meth:`observe` read it).

        Under ``WRITESCOPE_MICRO_BATCHES=auto`` a micro-batched share the gate refuses falls back
        to the whole-step share where that one pays, and the cache runs such steps whole
        (:meth:`splits_micro`, asked at each step with the batch's mean placed tokens). The gate charges
        O before the CPU part as in a whole step, which the halves partly hide; at DSV2 4 x 32K
        (O 0.8 ms a layer) it refused the micro-batched balance's 0.55 and the row placed nothing on
        the CPU: 84 ms a step, against 63-67 for whole steps at r 0.33 (run 67,
        benchmarks/results/gpu_decode_h200.md)."""
        r, _ = self._placement(placed_tokens, self.batch)
        return r

    def splits_micro(self, batch: int, placed_tokens: int) -> bool:
        """Whether a decode step of ``batch`` sequences with ``placed_tokens`` placed tokens each
        (their mean) runs as two micro-batches: the rule of scheduler/placement.py
        :func:`micro_batched`, except that under ``auto`` a step whose micro-batched split the
        gate refuses while the whole-step one pays runs whole (see :meth:`cpu_share`). Decided
        from the estimates as they are at the step; nothing is kept."""
        return self._placement(placed_tokens, batch)[1]

    def _placement(self, placed_tokens: int, batch: int) -> tuple[float, bool]:
        """(r, micro-batched) for ``placed_tokens`` per sequence at ``batch`` sequences, without
        changing the policy (the batch the estimates track is the caller's)."""
        rf, L, a = self.roofline, placed_tokens * batch, self.a.value
        c = self.c.value if batch == self._c_batch else self._start_c(batch)  # at another batch than the tracked one, its start
        if c != rf.c_cpu:  # the roofline itself is left as calibrated
            rf = replace(rf, c_cpu=c)
        X = self.experts.expected_bytes(batch) if self.experts is not None else 0.0
        # O where no per-step expert split runs (with one, the joint model sets r and O was measured
        # under other policies' expert path: attach_expert_work attaches the split for writescope only),
        # under the expert path this placement is expected to take (else the last step's at this batch)
        path = None
        if self.experts is not None and self.other is not None and X <= 0:
            path = expert_path(self.experts.expected_link_share(batch, L))
        o = self.other.seconds(batch, path) if self.other is not None and X <= 0 else None
        o_link = self.other.link(batch) if o is not None else 0.0
        # O in the balance where the step is not split into micro-batches (as InplaceKVCache.decode_groups splits)
        micro = micro_batched(self.micro_batches, batch, self.cpu_experts_from)
        r = self._share(L, a, rf, X, o, o_link, whole=not micro)
        if self.micro_batches == "auto" and micro and o is not None and X <= 0 and r <= 0:
            # auto: where the micro-batched split does not pay, whole steps may
            whole = self._share(L, a, rf, X, o, o_link, whole=True)
            if whole > 0:
                return whole, False
        return r, micro

    def _share(self, L: float, a: float, rf: Roofline, X: float, o: float | None, o_link: float, whole: bool) -> float:
        """:meth:`cpu_share`'s r for ``L`` batch tokens, gated (0 where the split is not predicted
        faster than streaming alone): O in the balance where ``whole`` (a step not split into
        micro-batches), with the link side's fixed cost capped as :meth:`cpu_share` says."""
        balance_o = o is not None and whole
        fixed = link_fixed_from_env() if balance_o else None
        if balance_o:  # the link side's fixed cost inside a whole-model step (LINK_FIXED), for the balance and the gate
            rf = replace(rf, c_gpu=min(rf.c_gpu, LINK_FIXED) if fixed is None else fixed)
        if X > 0:
            r, _ = joint_split(L, X, self.experts.costs())
        elif balance_o:
            r = roofline_share(L, a, rf.b, rf.c_cpu + o, rf.c_gpu + link_in_other(o, o_link, self.prefetch_tokens, rf.b))
        else:
            r = roofline_share(L, a, rf.b, rf.c_cpu, rf.c_gpu)
        if o is None:
            return r if split_pays(L, r, a, rf) else 0.0
        return r if split_pays(L, r, a, rf, o, o_link, self.prefetch_tokens, fixed or 0.0) else 0.0

    def _track_c(self, batch: int) -> None:
        """Track C_cpu at ``batch``: a new batch size starts from the C_cpu the meter kept for it,
        else from the calibration's."""
        if batch == self._c_batch:
            return
        self.c = OnlineEstimate(self._start_c(batch), self.c.alpha, self.c.window)
        self._c_batch = batch

    def _start_c(self, batch: int) -> float:
        """The C_cpu tracking starts from at ``batch``: the meter's kept one, else the calibration's."""
        kept = self.other.in_step_c(self._threads, batch) if self.other is not None else None
        return self.roofline.c_cpu if kept is None else kept

    def expect_batch(self, batch: int) -> None:
        self.batch = max(1, batch)
        self._track_c(self.batch)

    def observe(self, cpu_seconds: float, cpu_tokens: int, batch: int) -> None:
        """One measured CPU part of a decode step (``cpu_tokens`` > 0 and a finite time; else no
        sample). It teaches one of the two terms of T_cpu = C_cpu + A tokens, the one that
        dominates it by the calibration (C_cal, A_cal; the calibrated time, not the measured one,
        decides: a gate on the measured time would pass only the slow samples near the threshold):

        - where C_cal is at most :data:`MAX_FIXED_SHARE` of C_cal + A_cal tokens, A, as
          ``(cpu_seconds - C_cpu) / cpu_tokens`` (C_cpu the tracked one), floored at a tenth of
          A_cal (a part cheaper than the fixed cost says little about the per-token cost);
        - where A_cal tokens is at most :data:`C_BAND` of it, C_cpu, as ``cpu_seconds - A
          cpu_tokens`` (A the tracked one), kept within :data:`C_RANGE` x C_cal;
        - in between, neither: there an error in either term is a large error in the other.

        Calibration measured C_cpu 1.26 ms for DeepSeek-V2-Lite at batch 16 on an H100 host, where
        that batch's decode steps spent about 0.6 ms (run 62: parts of 20K-131K tokens took
        0.98-2.6 ms, about 15 ns a token beyond it), and with it the balance placed r 0.16-0.19 at
        16 x 8K, where a third ran 9% faster (benchmarks/results/gpu_decode_h200.md). C_cpu is
        tracked per batch size (a new one starts from the meter's kept value: :meth:`_track_c`)."""
        self.batch = max(1, batch)
        self._track_c(self.batch)
        rf = self.roofline
        if cpu_tokens <= 0 or not math.isfinite(cpu_seconds):  # no part, or no measurement
            return
        if rf.c_cpu <= MAX_FIXED_SHARE * (rf.c_cpu + rf.a * cpu_tokens):
            sample = (cpu_seconds - self.c.value) / cpu_tokens
            self.a.update(max(sample, A_FLOOR * self.roofline.a))
        elif rf.a * cpu_tokens <= C_BAND * (rf.c_cpu + rf.a * cpu_tokens):
            lo, hi = C_RANGE
            self.c.update(min(max(cpu_seconds - self.a.value * cpu_tokens, lo * rf.c_cpu), hi * rf.c_cpu))
