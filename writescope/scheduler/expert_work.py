"""The expert side of the joint roofline (scheduler/joint.py): what a layer step's hit host experts
weigh, what they cost the CPU, and each decode step's choice of which of them the link streams.

:class:`ExpertWork` is attached to the ``writescope`` policy and shared by the MoE blocks that have
host experts, each of which asks :meth:`ExpertWork.choose` once per decode layer step with its hit
host experts, after routing.

Which model applies depends on how a layer's expert phase shares the two resources with the
attention around it (``ExpertWork.balance``, ``WRITESCOPE_EXPERT_BALANCE``):

- ``phase`` (the default). The CPU cannot start layer l+1's attention before layer l's experts are
  done (its q depends on them), so the CPU's side of the expert phase starts empty. The link may
  not be idle there: it copies the next layer's load region ahead into the ping-pong buffers.
  So the expert split balances the CPU's experts against the link's streamed experts plus those
  copies x B: the tokens the split decoder copied early at the end of this layer's load part
  (``last_early_tokens``, ``WRITESCOPE_LOAD_COPIES``); without early copies, where the split is
  made on the device (the issuing thread does not wait for the experts and issues the next
  layer's copies meanwhile) min(the load region's tokens, the buffers' tokens
  ``policy.prefetch_tokens``), else none (the thread waits for the routing and issues the next
  layer's copies after the experts). r(L) is the KV roofline with O and the buffers' cap
  (scheduler/roofline.py).
- ``alone``: the expert phase balanced as if the link had nothing else to do (the default until
  the eighteenth session). On the H200 (run 56, benchmarks/results/gpu_decode_h200.md) it streamed
  344 of a Qwen3-30B-A3B 4 x 32K step's 720 hit host experts and took about 300 ms a step, where
  the CPU computing every one took 216-224: the buffers (128 MiB) hold nearly all of that layer's
  load region (64K tokens x 2 KiB), so the link was already busy through the expert phase.
- ``joint``: r(L) and the split from the joint model (scheduler/joint.py), the step's KV split
  read from the split decoder's last call and counted on each side, as if the CPU's attention
  could run beside the experts. It places no KV on the CPU for Mixtral-8x7B (r 0: 654-737 ms a
  step against 481-515 for ``alone``, runs 50 and 56), since there the CPU's attention in fact
  waits for the experts, and the link cannot stream a layer's load region (300 MB) ahead.

Only decode steps are chosen and observed: in a prefill (the decoder's ``last_split`` is None) the
block's fixed ``stream_share`` applies.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

from writescope.errors import plural
from writescope.scheduler.joint import JointCosts, streamed_count
from writescope.scheduler.roofline import OnlineEstimate, WriteScopePolicy

BALANCE_ENV = "WRITESCOPE_EXPERT_BALANCE"
BALANCES = ("phase", "alone", "joint")  # the models of the expert phase (module docstring); the first is the default

# After this many layer steps in a row that streamed every one of 2 or more hit host experts, the
# next gives one to the CPU: E is tracked from the CPU's calls, so without them an E measured too
# high (a loaded host, a slow first call) would keep the CPU idle for good. About one expert in
# 64 layer steps: a small share of a step's expert work. (It corrects the split's choices once the
# split is attached; whether to attach it, and from how many tokens, rest on the E measured at attach.)
# Where decode steps time the link's in-place reads (ExpertWork.link_timer), the converse too:
# after this many that streamed none of 2 or more, the next streams two (a timing of one is not
# used), so that a G measured too slow comes back up when the link gets faster.
PROBE_EVERY = 64


def expected_hit_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts hit by ``tokens`` tokens routing top-k of ``num_experts`` uniformly
    at random: E (1 - (1 - k/E)^T). (Synthetic weights route nearly uniformly; real text less so:
    the tracked value replaces this once steps are observed.)"""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** tokens)


def expected_host_expert_bytes(blocks: list, tokens: int) -> float:
    """Expected weight bytes of the hit routed experts in host memory over ``blocks`` (MoE blocks
    with a host pack) in a decode step of ``tokens`` tokens: per block its share of experts in
    host memory times :func:`expected_hit_experts` times one expert's bytes (uniform routing)."""
    return sum(len(b.host_experts) / b.cfg.num_experts * expected_hit_experts(tokens, b.cfg.num_experts, b.cfg.top_k)
               * b.host_pack.expert_nbytes for b in blocks if b.host_experts and b.host_pack is not None)


class ExpertWork:
    """Tracked expert costs and the per-step expert split.

    Args:
        e: initial CPU seconds per expert weight byte (a measurement: :func:`measure_cpu_expert_cost`).
        g: link seconds per byte at attach (the slower of B / KV bytes per token and the fused
            kernels' in-place read): the seed of ``g_link``, which decode steps track where
            ``link_timer`` is set (:meth:`observe_link`).
        host_fraction: routed experts in host memory / all routed experts (over the hosted blocks).
        expert_bytes: weight bytes of one routed expert.
        num_experts, top_k: the routing.
        decoder: the split decoder whose last call gives this step's KV split (``last_split``).
        policy: the ``writescope`` policy: its online A and its roofline (B, C_cpu, C_gpu).
        call: the CPU's fixed seconds per expert call (measured with ``e``), >= 0: each step's
            choice counts it once when the CPU takes any expert, and a call's time less it
            updates E.

    ``link_samples``: the in-step timings ``g_link`` has taken. Counters ``n_streamed`` and ``n_computed`` add up the experts of every layer step (the trace reads
    and resets them).
    """

    def __init__(self, e: float, g: float, host_fraction: float, expert_bytes: int, num_experts: int, top_k: int, decoder=None,
                 policy=None, alpha: float = 0.3, window: int = 3, call: float = 0.0):
        if not (e > 0 and g > 0 and math.isfinite(e) and math.isfinite(g)):
            raise ValueError(f"expert costs must be positive and finite, got E={e}, G={g} s/byte")
        if not (call >= 0 and math.isfinite(call)):
            raise ValueError(f"the CPU's fixed seconds per expert call must be finite and >= 0, got {call}")
        self.e = OnlineEstimate(e, alpha, window)
        self.call = call
        self.g = g
        self.host_fraction, self.expert_bytes = host_fraction, expert_bytes
        self.num_experts, self.top_k = num_experts, top_k
        self.alpha, self.window = alpha, window
        self.x = OnlineEstimate(0.0, alpha, window)  # hit host expert bytes per decode layer step (seeded by the first)
        self.observed = False
        self.decoder, self.policy = decoder, policy
        self._balance = "phase"
        self.n_streamed = self.n_computed = 0
        self.expected = False  # the counters add up expected experts (share_for), not counted ones
        self.unmeasured = 0  # layer steps in a row that streamed every hit host expert (see PROBE_EVERY)
        self.why = ""  # why the split was taken over the in-place read, in words ("" when that was not possible)
        # G's sources (seconds per byte): the KV copies' rate, and the fused kernels' in-place read where it was
        # measured (measure_link_expert_cost; None: not measured); g is the slower of the two
        self.g_kv, self.g_read = g, None
        # G tracked from decode steps (observe_link), seeded with g, the value at attach; the timer of the
        # link's in-place reads (moe/link_timing.LinkTimer) where the blocks take the worker path on CUDA
        self.g_link = OnlineEstimate(g, alpha, window)
        self.link_samples = 0
        self.link_timer = None
        self.unstreamed = 0  # layer steps in a row that streamed none of 2 or more (see PROBE_EVERY)
        self.probing = False  # the last choice streamed two to measure the link: time them
        # decode passes of fewer tokens read their host experts in place instead (the blocks ask:
        # SparseMoeBlock._host_in_place_configured); 0: the split takes every pass
        self.in_place_below = 0

    @property
    def balance(self) -> str:
        """``phase`` (the default), ``alone`` or ``joint``: the model of the expert phase (module docstring)."""
        return self._balance

    @balance.setter
    def balance(self, value: str) -> None:
        if value not in BALANCES:
            raise ValueError(f"expert balance {value!r}: use one of {', '.join(BALANCES)}")
        self._balance = value

    @property
    def overlap(self) -> bool:
        """Whether r(L) comes from the joint model (``balance`` ``joint``): the expert phase
        counted as if it ran beside the attention."""
        return self.balance == "joint"

    def expected_bytes(self, batch: int) -> float:
        """Hit host expert bytes per layer step that r(L) plans for: 0 unless ``balance`` is
        ``joint`` (the phases are balanced apart); else the tracked value, or before any decode
        step the uniform routing expectation for ``batch`` decode tokens."""
        if not self.overlap:
            return 0.0
        if self.observed:
            return self.x.value
        return expected_hit_experts(batch, self.num_experts, self.top_k) * self.host_fraction * self.expert_bytes

    def costs(self) -> JointCosts:
        """The joint costs with the current estimates (A and C_cpu from the policy, E tracked)."""
        rf, a = self.policy.roofline, self.policy.a.value
        return JointCosts(a=a, b=rf.b, e=self.e.value, g=self.g_link.value, c_cpu=self.policy.c.value, c_gpu=rf.c_gpu)

    def decoding(self) -> bool:
        """Whether the layer being run is a decode step (the split decoder ran for it)."""
        return self.decoder is None or getattr(self.decoder, "last_split", None) is not None

    def choose(self, sizes: list[int], on_device: bool = False) -> int | None:
        """How many of this decode layer step's hit host experts (``sizes``: weight bytes each, in
        the block's streaming order) to stream; the CPU computes the rest. Records the step's
        bytes. None in a prefill (the block's fixed share applies). ``on_device``: the split is
        made on the device and the issuing thread does not wait for it (:meth:`share_for`)."""
        if not self.decoding():
            return None
        total = float(sum(sizes))
        if not self.observed:  # seeded with the first sample, not averaged up from 0
            self.x = OnlineEstimate(total, self.alpha, self.window)
        self.x.update(total)
        self.observed = True
        c = self.costs()
        cpu_s, link_s = self.phase_start(c, on_device)
        k = streamed_count(sizes, cpu_s, link_s, c, self.call)
        if k == len(sizes) >= 2:  # the CPU took none: E is not measured, and one too high would never come down
            self.unmeasured += 1
            if self.unmeasured >= PROBE_EVERY:
                k -= 1  # one expert on the CPU now and then keeps E measured
                self.unmeasured = 0
        elif k < len(sizes):
            self.unmeasured = 0
        self.probing = False
        if k == 0 and len(sizes) >= 2 and self.link_timer is not None:  # the same for G where steps time the link
            self.unstreamed += 1
            if self.unstreamed >= PROBE_EVERY:
                # two: a timing of one small expert is not used (moe/link_timing.MIN_EXPERTS, MIN_BYTES), and on the
                # device the share 1/m of fewer hits than expected can round to none
                k = 2
                self.unstreamed = 0
                self.probing = True  # the block times this choice (moe/async_experts._link_timer)
        elif k > 0:
            self.unstreamed = 0
        self.n_streamed += k
        self.n_computed += len(sizes) - k
        return k

    def phase_start(self, c: JointCosts, on_device: bool = False) -> tuple[float, float]:
        """``(cpu_s, link_s)``: what each side already has to do in this decode layer step's
        expert phase, by ``balance`` (module docstring), from the decoder's last call: ``phase``
        (0, the next layer's KV tokens copied early x B, or without early copies and ``on_device``
        min(load-region tokens, the ping-pong buffers' tokens) x B, else 0); ``alone`` (0, 0);
        ``joint`` (the CPU's KV x A + C_cpu, the link's KV x B + C_gpu). (0, 0) in a prefill or
        without a decoder."""
        if self.decoder is None or self.balance == "alone" or not self.decoding():
            return 0.0, 0.0
        cpu_tokens, load_tokens = self.decoder.last_split
        if self.balance == "joint":
            return cpu_tokens * c.a + (c.c_cpu if cpu_tokens else 0.0), load_tokens * c.b + c.c_gpu
        early = getattr(self.decoder, "last_early_tokens", 0)
        # G tracked from decode steps was timed beside these copies, so they are counted twice once it
        # is: kept so, on purpose, while streamed experts lose more often than the model expects (run 58)
        if early or not on_device:
            return 0.0, early * c.b
        ahead = getattr(self.policy, "prefetch_tokens", None)
        return 0.0, (load_tokens if ahead is None else min(load_tokens, ahead)) * c.b

    def share_for(self, tokens: int, block) -> float | None:
        """The share of ``block``'s hit host experts the link reads in a decode layer step of
        ``tokens`` tokens whose split is made on the device before the host knows the routing
        (moe/async_experts.py): :meth:`choose` over the expected hit host experts (uniform
        routing, :func:`expected_hit_experts`, at least one), as a fraction. None in a prefill.
        The counters then add up expected experts, not counted ones."""
        if not self.decoding():
            return None
        n = expected_hit_experts(tokens, block.cfg.num_experts, block.cfg.top_k) * len(block.host_experts) / block.cfg.num_experts
        m = max(1, round(n))
        self.expected = True
        k = self.choose([block.host_pack.expert_nbytes] * m, on_device=True)
        return k / m

    def expected_link_share(self, batch: int, load_tokens: float) -> float:
        """The share of a decode layer step's hit host experts the link is expected to read at
        ``batch`` decode tokens with ``load_tokens`` tokens (all sequences') in the load region:
        1 where such passes read their host experts in place (fewer than :attr:`in_place_below`
        tokens), else :func:`~writescope.scheduler.joint.streamed_count` over the expected hits
        (uniform routing, at least one) with each side's start as :meth:`phase_start` gives it
        (``phase``: the link busy with min(``load_tokens``, the ping-pong buffers' tokens) x B;
        ``joint``: the link with all of them and C_gpu, the CPU with nothing placed; ``alone``:
        neither), as a fraction. Records nothing. The meter of O keys O by this path
        (scheduler/other_work.py). An expectation: where a step copies fills early,
        :meth:`choose` starts the link at the tokens it did copy early, at most the buffers' tokens,
        and the expected hits stand for the routed ones."""
        if batch < self.in_place_below:
            return 1.0
        m = max(1, round(expected_hit_experts(batch, self.num_experts, self.top_k) * self.host_fraction))
        c = self.costs()
        if self.balance == "alone":
            link_s = 0.0
        elif self.balance == "joint":
            link_s = load_tokens * c.b + c.c_gpu
        else:
            ahead = getattr(self.policy, "prefetch_tokens", None)
            link_s = (load_tokens if ahead is None else min(load_tokens, ahead)) * c.b
        return streamed_count([self.expert_bytes] * m, 0.0, link_s, c, self.call) / m

    def observe(self, seconds: float, nbytes: int) -> None:
        """One measured CPU expert call: ``seconds`` for ``nbytes`` of expert weights; E is
        updated with the call's time less its fixed part (at least a tenth of the call's time: a
        fixed part measured too large does not drive E to 0)."""
        if nbytes > 0 and seconds > 0 and self.decoding():  # a prefill's experts have many tokens: not E
            self.e.update(max(seconds - self.call, 0.1 * seconds) / nbytes)

    def observe_link(self, seconds: float, nbytes: int) -> None:
        """One timed read of the link's host experts in a decode step (moe/link_timing.py):
        ``seconds`` for ``nbytes`` of expert weights, all counted per byte (the launches too: the
        step pays them). G follows it as E follows the CPU's calls."""
        if nbytes > 0 and seconds > 0 and math.isfinite(seconds):
            self.g_link.update(seconds / nbytes)
            self.link_samples += 1

    def take_counts(self) -> tuple[int, int]:
        """``(streamed, computed)`` experts since the last call."""
        out = (self.n_streamed, self.n_computed)
        self.n_streamed = self.n_computed = 0
        return out


# A fixed part larger than this share of a one-expert call is not believed (expert_cost_line). On
# the H200 the fits gave 0.00-0.01 ms a call, and once (Mixtral-8x7B, run 36) 13 ms beside
# 855 GB/s: a one-expert call timed 4x too slow, which made the CPU look nearly free per byte.
MAX_CALL_SHARE = 0.5


def expert_cost_line(one: float, many: float, n: int, nbytes: int) -> tuple[float, float]:
    """``(e, call)`` from a call over one expert (``one`` seconds) and over ``n`` experts (``many``),
    each of ``nbytes`` weight bytes: the line through the two (seconds per byte, seconds per call).
    All of a call's time is counted per byte, with ``call`` 0, where the line is not believable:
    one expert (``n`` 1), a slope that noise made <= 0, or a fixed part above
    :data:`MAX_CALL_SHARE` of the one-expert call (then ``many`` is the better measurement).

    Raises:
        ValueError: a time not positive and finite, ``n`` < 1 or ``nbytes`` < 1.
    """
    if not (one > 0 and many > 0 and math.isfinite(one) and math.isfinite(many)) or n < 1 or nbytes < 1:
        raise ValueError(f"expert call timings must be positive and finite over >= 1 expert of >= 1 byte, got "
                         f"one={one}, many={many} s, n={n}, nbytes={nbytes}")
    average = (many / (n * nbytes), 0.0)
    if n < 2:
        return average
    slope = (many - one) / ((n - 1) * nbytes)
    call = one - slope * nbytes
    if not slope > 0 or call > MAX_CALL_SHARE * one:
        return average
    return slope, max(0.0, call)


def measure_cpu_expert_cost(block, experts: int = 8, reps: int = 3) -> tuple[float, float]:
    """``(e, call)``: CPU seconds per expert weight byte of ``block``'s host expert path (the C++
    kernel where it is used) and its fixed seconds per call, from calls with one random token on
    each of 1 and of up to ``experts`` host experts (each the fastest of ``reps`` calls after one
    unmeasured call: the noise of a timing only adds), through :func:`expert_cost_line`. A decode
    layer step's CPU call has 1-4 experts, where the fixed part is a visible share. The starting
    values of E (tracked from then on) and of the fixed part."""
    import time

    import torch

    host = sorted(block.host_experts)[:experts]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(host), block.gate.weight.shape[1], generator=g).to(block.host_pack.w13.dtype)
    nbytes = block.host_pack.expert_nbytes

    def timed(n: int) -> float:
        w = torch.full((n,), 1.0 / n)
        times = []
        with torch.no_grad():
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                block._host_experts(host[:n], [1] * n, x[:n], w)
                times.append(time.perf_counter() - t0)
        return min(times[1:])

    many = timed(len(host))
    one = timed(1) if len(host) >= 2 else many
    return expert_cost_line(one, many, len(host), nbytes)


def measure_link_expert_cost(block, experts: int = 8, reps: int = 3) -> float | None:
    """Link seconds per weight byte of ``block``'s host experts read in place over PCIe by the fused
    decode kernels (moe/fused_decode.py), as the asynchronous expert path reads the link's share
    (moe/async_experts.py): calls with one random token on each of 1 and of up to ``experts`` host
    experts (fewer where they weigh more than about 2 GB), each the fastest of ``reps`` after one
    unmeasured call, timed by CUDA events with the device otherwise idle, through
    :func:`expert_cost_line` (the slope; the fixed part, launches and the slots not hit, is left out). None without CUDA, Triton or host experts: then G stays the
    KV copies' rate.

    Why: G was taken from the KV copies' rate (B), but the link's experts are not copied on that
    path. On an H100 host (run 57, Mixtral-8x7B 4 x 32000) streaming 28 of 122 hit host experts a
    step took 2.6 ms a layer longer than the CPU computing them all, where G from B (51 GB/s)
    expected it to save time: the in-place read came to about 28 GB/s. Measured with the host's
    CPUs idle, where in a step the expert worker reads host memory at the same time: an
    optimistic figure, as the KV copies' rate is."""
    import torch

    from writescope.moe import fused_decode

    w = block.gate.weight
    if w.device.type != "cuda" or fused_decode.triton is None or not block.host_experts or block.host_pack is None:
        return None
    w13, w2, slot_of = block._host_device_views(w.device)
    # at most about 2 GB a call (Mixtral-8x7B's experts are 352 MB each), at least 2 experts for the line
    host = sorted(block.host_experts)[:max(2, min(experts, int(2e9 // block.host_pack.expert_nbytes)))]
    g = torch.Generator(device=w.device).manual_seed(0)
    x = (0.02 * torch.randn(len(host), w.shape[1], generator=g, device=w.device)).to(w13.dtype)
    ids = torch.tensor(host, dtype=torch.long, device=w.device).view(-1, 1)  # one token on each expert, top-1
    weights = torch.ones(len(host), 1, dtype=torch.float32, device=w.device)
    out = torch.zeros(len(host), w.shape[1], dtype=torch.float32, device=w.device)
    inter = block.cfg.intermediate_size

    def timed(n: int) -> float:
        times = []
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fused_decode.fused_experts_into(x[:n], weights[:n], ids[:n], slot_of, w13, w2, inter, out[:n])
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return min(times[1:])

    with torch.no_grad():
        many = timed(len(host))
        one = timed(1) if len(host) >= 2 else many
    return expert_cost_line(one, many, len(host), block.host_pack.expert_nbytes)[0]


# What the per-step split costs a decode layer step beyond its balanced expert phase, against the
# host experts read in place (seconds): the routing read back to the host (a device wait), the
# block without a CUDA graph, and the CPU's experts computed on the issuing thread, which issues
# nothing meanwhile. From run 18 (Qwen3-30B-A3B 4 x 32K, 48 layers, about 138 MB of hit host
# experts a layer step, benchmarks/results/gpu_decode_h200.md): the split 428 ms a step against
# 343 streaming every host expert through the same read-back path, where the model expected the
# split 1.4 ms a layer faster (3.2 ms a layer unmodelled), and that path 39 ms (0.8 ms a layer)
# slower than the in-place read.
SPLIT_OVERHEAD_S = 4.0e-3
# The same with the CPU's share on the native expert worker and the split made on the device
# (moe/async_experts.py): no read-back and nothing computed on the issuing thread; what is left is
# the split's dozen small launches, three copies to pinned memory, the flag hand-over both ways, the
# worker's grouping and the graphs cut around the block. Measured in run 60 (an H100 host,
# benchmarks/results/gpu_decode_h200.md): DeepSeek-V2-Lite 16 x 8K holds one host expert in each of
# its 26 MoE layers (17 MB, hit in about 79% of layer steps); with the CPU computing them the step
# took 105.8 / 113.7 ms against 74.7 / 73.2 read in place, at the same r, where the balance expected
# the CPU about 0.1 ms a layer step faster: 1.3-1.7 ms a layer step unmodelled. Qwen3-30B-A3B 4 x 8K
# (run 60's grid: `cpu@expert_stream_share=0` 147-161 ms against `cpu` 201-203, 138 MB a layer step,
# E 85 and G 38 GB/s, the model expecting 2.0 ms a layer step saved and 0.8-1.2 measured) gives
# 0.8-1.2 ms. 1.2 ms is where the two meet (the estimate before was 0.3 ms, with which the split
# took DeepSeek-V2-Lite's few host experts and cost up to half its speed). Run 61 (H200): with it
# DeepSeek-V2-Lite 16 x 8K reads them in place, 62.8 / 65.7 ms a step against 63.9 / 62.5 for
# static:0.333333. Those rows were issue-bound in the cut form (the MoE block issued eagerly); run 61
# also made the whole capture the default (WRITESCOPE_GRAPH_EXPERTS), which halves the issue time,
# so this figure, fitted on the cut form, may now be too high: fit it again from grids in that form.
# (These fits took the experts as divisible; since the twenty-fourth session the attach decision
# counts whole experts (expert_phase_seconds), which alone reads DeepSeek-V2-Lite's one host expert a
# layer in place at 0.3 ms too.)
ASYNC_SPLIT_OVERHEAD_S = 1.2e-3


class LayerHits(NamedTuple):
    """One MoE layer's host experts in a decode step of some tokens, under uniform routing: ``experts``
    routed experts in host memory, each hit with probability ``p`` (:func:`layer_hits`), each of
    ``nbytes`` weight bytes."""

    experts: int
    p: float
    nbytes: int


def layer_hits(block, tokens: int) -> LayerHits:
    """:class:`LayerHits` of ``block`` (a MoE block with a host pack, or without host experts) at
    ``tokens`` decode tokens: each routed expert is hit with probability 1 - (1 - k/E)^T
    (:func:`expected_hit_experts` over E)."""
    hosted = len(block.host_experts) if block.host_experts and block.host_pack is not None else 0
    if hosted == 0:
        return LayerHits(0, 0.0, 0)
    p = expected_hit_experts(tokens, block.cfg.num_experts, block.cfg.top_k) / block.cfg.num_experts
    return LayerHits(hosted, p, block.host_pack.expert_nbytes)


def whole_split_seconds(n: int, nbytes: float, e: float, g: float, call: float = 0.0) -> float:
    """Seconds of ``n`` hit host experts of ``nbytes`` each split in whole experts between the CPU
    (``e`` s/byte, ``call`` s when it takes any) and the link (``g`` s/byte), both at once: the
    best j on the CPU of max(j nbytes e + call, (n - j) nbytes g). The balance point (n g nbytes -
    call) / (nbytes (e + g)) and its neighbours are the only candidates besides 0 and n, since the
    CPU's side grows and the link's falls with j."""
    if n <= 0:
        return 0.0
    per = nbytes * (e + g)
    mid = (n * nbytes * g - call) / per if per > 0 else 0.0
    best = n * nbytes * g  # all on the link
    for j in {n, max(1, min(n, math.floor(mid))), max(1, min(n, math.ceil(mid)))}:
        best = min(best, max(j * nbytes * e + call, (n - j) * nbytes * g))
    return best


def expert_phase_seconds(layers: list[LayerHits], e: float, g: float, overhead: float = SPLIT_OVERHEAD_S,
                         call: float = 0.0) -> tuple[float, float]:
    """``(in_place, split)``: expected seconds of a decode step's host-expert phases, summed over
    its layers, read in place over PCIe (every hit expert's bytes at the link's ``g``) or split
    each layer step between the link and the CPU in whole experts (:func:`whole_split_seconds`),
    plus ``overhead`` per layer step that has host experts.

    Args:
        layers: each MoE layer's host experts (:func:`layer_hits`).
        e: CPU seconds per expert weight byte; g: link seconds per byte (both > 0).
        overhead: the split's cost per layer step beyond the balance (:data:`SPLIT_OVERHEAD_S`).
        call: the CPU's fixed seconds of a call with any experts (:func:`measure_cpu_expert_cost`).

    The split is averaged over the number of hit host experts, binomial (experts, p) under uniform
    routing. Whole experts matter where a layer has few: DeepSeek-V2-Lite at batch 16 under 32 GiB
    has one host expert a layer, which the CPU computes or the link reads, never both; taken as
    divisible (X e g / (e + g), the model until the twenty-fourth session) the split was expected to
    gain about twice what any split of one expert can.

    Raises:
        ValueError: e or g not positive and finite; a negative or NaN overhead, call, count, p
            outside [0, 1] or negative bytes.
    """
    if not (e > 0 and g > 0 and math.isfinite(e) and math.isfinite(g)):
        raise ValueError(f"expert costs must be positive and finite, got E={e}, G={g} s/byte")
    if not overhead >= 0 or not call >= 0 or any(not (h >= 0 and 0 <= p <= 1 and s >= 0) for h, p, s in layers):
        raise ValueError(f"expert counts, bytes, the overhead and the call must be >= 0 and p in [0, 1], got "
                         f"{layers[:3]}{'...' if len(layers) > 3 else ''}, overhead {overhead}, call {call}")
    in_place = split = 0.0
    for h, p, s in layers:
        if h == 0 or p == 0 or s == 0:
            continue
        in_place += h * p * s * g
        split += overhead + sum(math.comb(h, n) * p ** n * (1 - p) ** (h - n) * whole_split_seconds(n, s, e, g, call)
                                for n in range(1, h + 1))
    return in_place, split


def split_from(blocks: list, most_tokens: int, e: float, g: float, overhead: float = SPLIT_OVERHEAD_S,
               call: float = 0.0) -> int | None:
    """The fewest decode tokens, up to ``most_tokens``, at which the per-step split of ``blocks``'
    hit host experts is expected to beat reading them in place (:func:`expert_phase_seconds` under
    uniform routing, whose hits grow with the tokens), or None when it never is."""
    lo, hi = 1, most_tokens
    if hi < 1:
        return None

    def wins(tokens: int) -> bool:
        in_place, split = expert_phase_seconds([layer_hits(b, tokens) for b in blocks], e, g, overhead, call)
        return split < in_place

    if not wins(hi):
        return None
    while lo < hi:  # the split's gain grows with the hits, so the first win is found by bisection
        mid = (lo + hi) // 2
        if wins(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def balance_from_env() -> str:
    """``WRITESCOPE_EXPERT_BALANCE``: ``phase`` (the default), ``alone`` or ``joint``: which model
    balances the per-step expert split and r(L) (the module docstring says each, and what the H200
    measured).

    Raises:
        ValueError: another value (names it).
    """
    from writescope.env import env_choice

    return env_choice(BALANCE_ENV, BALANCES)


def detach_expert_work(policy, blocks: list) -> None:
    """No per-step expert split: the blocks take their fixed ``stream_share`` (or read in place)."""
    for b in blocks:
        b.expert_work = None
    if isinstance(policy, WriteScopePolicy):
        policy.experts = None


def attach_expert_work(policy, decoder, blocks: list, kv_bytes_per_token: int, fixed_share: bool,
                       decode_tokens: int | None = None) -> ExpertWork | None:
    """Give the ``writescope`` policy and the MoE blocks with host experts one :class:`ExpertWork`
    (the joint roofline), or detach it: for another policy, when the user fixed the expert stream
    share (``--expert-stream-share``, the fixed baseline), when no block can stream its host
    experts (then the CPU computes them all and r(L) is the KV-only one), or when every hosted
    block reads its hit host experts in place inside the fused decode kernels for every decode
    step up to ``decode_tokens`` tokens (:meth:`SparseMoeBlock.reads_host_experts_in_place`; r(L)
    is then the KV-only one too; a batch whose assignments could exceed the kernels' row limit
    keeps the split for all of its steps) and the in-place read is expected to be faster there.

    Why the in-place read usually wins over the per-step split where it runs: the split must read each
    layer's routing back to the host (a device wait in every MoE layer, no CUDA graph for the
    block) and computes the CPU's experts on the issuing thread, while the in-place read issues
    nothing per expert. Measured on the H200 (run 18, benchmarks/results/gpu_decode_h200.md),
    Qwen3-30B-A3B 4 x 32K under 32 GiB, one process: ``writescope`` with the split 428 ms per
    step, the same KV share (``static:0.5``) with its host experts read in place 304 ms.
    ``WRITESCOPE_MOE_KERNEL=grouped`` brings the split back. Where the host experts' bytes
    dominate the step the split wins instead (Mixtral-8x7B 4 x 8K, run 34: every few-token host
    expert computed on the CPU 433 ms a step, read in place 961 ms): with ``decode_tokens`` known,
    :func:`expert_phase_seconds` compares the two at that many tokens and the split is attached
    when it is expected to be faster at that many tokens, from the fewest tokens a decode step at
    which it is (``work.in_place_below``: smaller passes still read in place; ``work.why`` says
    so, with the two estimates). With ``decode_tokens`` None the in-place read is kept.

    Args:
        policy: the cache's placement policy.
        decoder: the cache's split decoder (its ``last_split``), or None.
        blocks: every SparseMoeBlock of the model.
        kv_bytes_per_token: KV bytes of one token of one layer (G = B / this).
        fixed_share: the user gave an expert stream share.
        decode_tokens: the most tokens a decode step runs (the engine's ``max_batch``), None: not
            checked.

    Returns:
        The attached ExpertWork, or None.
    """
    detach_expert_work(policy, blocks)
    if fixed_share or not isinstance(policy, WriteScopePolicy):
        return None
    hosted = [b for b in blocks if b.host_experts and b.streams_host_experts()]
    if not hosted:
        return None
    g = policy.roofline.b / kv_bytes_per_token
    e = call = None
    why = ""
    first = 0
    w = hosted[0].gate.weight
    on_worker = all(b.takes_async(w.dtype, w.device, decode_tokens) for b in hosted)
    overhead = ASYNC_SPLIT_OVERHEAD_S if on_worker else SPLIT_OVERHEAD_S
    g_kv, g_read = g, None
    if on_worker:  # the link's share read in place by the fused kernels: its own rate, for the decision below too
        try:
            g_read = measure_link_expert_cost(hosted[0])
        except Exception as err:  # noqa: BLE001 (Triton's errors are not RuntimeErrors): G from the KV copies, said
            warnings.warn(f"could not measure the fused kernels' in-place read of host experts ({err}); "
                          "the expert split takes G from the KV copies' rate", stacklevel=2)
        if g_read is not None and g_read > g:  # slower than the KV copies: the in-place read bounds it
            g = g_read
    if all(b.reads_host_experts_in_place(decode_tokens) for b in hosted):
        if decode_tokens is None:
            return None
        most = [layer_hits(b, decode_tokens) for b in hosted]
        if sum(h * p * s for h, p, s in most) * g <= len(most) * overhead:  # read in place faster than the split's overhead alone
            return None
        e, call = measure_cpu_expert_cost(hosted[0])
        first = split_from(hosted, decode_tokens, e, g, overhead, call)
        if first is None:
            return None
        in_place_s, split_s = expert_phase_seconds(most, e, g, overhead, call)
        why = (f"split from {plural(first, 'token')} a decode step, read in place over PCIe below; at {decode_tokens} tokens the"
               f" expert phase would take about {in_place_s * 1e3:.0f} ms read in place, {split_s * 1e3:.0f} ms split")
    cfg = hosted[0].cfg
    total = sum(b.cfg.num_experts for b in blocks)
    if e is None:
        e, call = measure_cpu_expert_cost(hosted[0])
    work = ExpertWork(e, g, sum(len(b.host_experts) for b in blocks) / total, hosted[0].host_pack.expert_nbytes,
                      cfg.num_experts, cfg.top_k, decoder, policy, call=call)
    work.g_kv, work.g_read = g_kv, g_read
    if on_worker and w.device.type == "cuda":  # G tracked from decode steps too (moe/link_timing.py)
        from writescope.moe.link_timing import LinkTimer

        work.link_timer = LinkTimer()
    work.why, work.in_place_below = why, first
    work.balance = balance_from_env()
    policy.experts = work
    for b in hosted:
        b.expert_work = work
    return work
