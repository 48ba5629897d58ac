"""A decode layer's host experts off the issuing thread: the CPU's share on the native expert worker
(moe/expert_worker.py), the link's share read in place over PCIe by the fused decode kernels, the
split made on the device from the routing, so the thread that issues the step never waits
(issue 14 item 3, issue 15 item 3; docs/DESIGN.md section 6).

Before this path (``SparseMoeBlock._split_forward``) a layer with host experts read its routing
back to the host (``bincount(...).tolist()``, a device wait), computed the CPU's experts on the
issuing thread and only then issued the rest of the layer: the device drained at every MoE layer
and the split cost about 4 ms a layer step beyond its balance on the H200
(``scheduler/expert_work.SPLIT_OVERHEAD_S``), so the CPU stayed idle through the expert phase.

One layer, in stream order (nothing on the host waits):
1. the split, on the device (:func:`partition`): of the layer's hit host experts, those with at
   least ``stream_min_tokens`` tokens and then a ``share`` of the rest, most tokens first (ties:
   the lower id), go to the link; the CPU computes the others. ``share`` is the block's fixed
   ``stream_share`` or the joint roofline's choice for the step (scheduler/expert_work.py,
   ``ExpertWork.share_for``), chosen before routing from the expected hits;
2. x, the CPU's slots and the routing weights copied to pinned memory, the worker's ready flag
   set behind them; the worker groups the assignments and runs the C++ expert kernel;
3. the device experts and the link's host experts in the fused kernels (two launches each); now
   and then (moe/link_timing.py) CUDA events time the link's, and a later layer hands the timing
   to the joint roofline's G once it has passed;
4. the stream waits for the worker's done flag and adds its ``[T, D]`` fp32 sum into ``out``, read
   where the worker wrote it in pinned memory (``WRITESCOPE_EXPERT_OUTPUT``: :func:`output_in_place`).

Without CUDA (the tests) the "device" is the CPU: the host sets the ready flag, the link's share
and the device experts run as torch GEMMs (the reference), and the host waits for the worker.

``WRITESCOPE_EXPERT_WORKER``: ``auto`` (the default: on with CUDA), ``on`` (also without CUDA, for
tests), ``off`` (the old path: routing read back, the CPU's experts on the issuing thread).
"""

from __future__ import annotations

import warnings

import torch

from writescope.engine import replay_hooks
from writescope.engine.threads import default_attention_threads
from writescope.env import env_choice
from writescope.moe import fused_decode
from writescope.moe.link_timing import link_expert_count
from writescope.native.team import team_wanted

ENV = "WRITESCOPE_EXPERT_WORKER"


GRAPH_ENV = "WRITESCOPE_GRAPH_EXPERTS"
# The first item of a stage's graph key whose MoE block takes this path (moe/block.py
# ``_async_graph_key``; models/graphs.py ``expert_path`` keeps one graph per path).
GRAPH_KEY_MARK = "async"


def graph_wanted() -> bool:
    """``WRITESCOPE_GRAPH_EXPERTS``: ``on`` (the default) captures a decode stage whose MoE block
    hands its CPU share to the worker whole, the job handed over at each replay
    (:func:`captured_into`); ``off``: such a stage is cut around the block, the block issued eagerly
    (models/decode_step.py). On the H200 (run 61, benchmarks/results/gpu_decode_h200.md) ``on`` took
    Qwen3-30B-A3B's decode step from 138-149 to 104-106 ms at 4 x 8K, 164-167 to 121-126 at 4 x 16K,
    202 to 178-186 at 4 x 32K and 272-292 to 261-262 at 16 x 8K: the issuing thread's time per
    step fell to 0.45-0.69 of the cut form's (157 to 70 ms at 4 x 8K), where the cut form kept the
    step issue-bound.

    Raises:
        ValueError: a value other than on/off (names it).
    """
    return env_choice(GRAPH_ENV, ("on", "off")) == "on"


OUTPUT_ENV = "WRITESCOPE_EXPERT_OUTPUT"


def output_in_place() -> bool:
    """``WRITESCOPE_EXPERT_OUTPUT``: how the device gets the worker's sum y (``[T, D]`` fp32, pinned).
    ``in-place`` (the default): the add kernel reads y where the worker wrote it, over PCIe through
    its device address (unified addressing), with no copy. ``copy``: y is copied to the device first,
    a host-to-device copy on the compute stream. That copy queues on the copy engine behind the
    ping-pong fills already issued for the next layer: in run 63's timeline (an H100 host,
    Qwen3-30B-A3B 4 x 16K, benchmarks/results/gpu_decode_h200.md) the 32 KiB copy ran 0.6 ms after
    the done flag at a CPU share of 0.2 and 1.3 ms after it at 0, each layer, the device idle
    meanwhile. The worker's CPU attention partial is read in place for the same reason
    (``WRITESCOPE_CPU_PARTIAL``). A stage captured with one form is never replayed for the other
    (the blocks' graph key holds it). Without CUDA y is added as it lies either way.

    Raises:
        ValueError: another value (names it).
    """
    return env_choice(OUTPUT_ENV, ("in-place", "copy")) == "in-place"


def _add_output(worker, bufs: tuple, out: torch.Tensor, cuda: bool, in_place: bool) -> None:
    """``out += y`` (``bufs[3]``, the worker's sum) on the current stream: read in place
    (:func:`output_in_place`) or copied first; ``cuda`` False: y is in host memory, as ``out`` is."""
    if cuda and in_place:
        out.add_(worker.output_view(bufs, out.device))
    else:
        out.add_(bufs[3].to(out.device, non_blocking=cuda))


def worker_wanted(device: torch.device) -> bool:
    """Whether host experts of blocks on ``device`` take this path (``WRITESCOPE_EXPERT_WORKER``).

    Raises:
        ValueError: a value other than ``auto``, ``on`` or ``off`` (names it).
    """
    mode = env_choice(ENV, ("auto", "on", "off"))
    return mode == "on" or (mode == "auto" and device.type == "cuda")


class WorkerHandle:
    """One native expert worker shared by a model's MoE blocks, made on first use with
    :attr:`threads` OpenMP threads. Where it cannot start (no Triton on CUDA, the kernel not
    built), ``get`` returns None after one warning and the blocks keep the old path.

    Args:
        threads: the worker's OpenMP threads (>= 1), fixed (``--expert-threads``); None: as many
            as the CPU attention's default (:func:`writescope.engine.threads.default_attention_threads`,
            so ``WRITESCOPE_CPU_THREADS`` where set), read at each :meth:`refresh` (a bench row's
            switches) and at the first make before any refresh.
        device: the device the blocks run on (with CUDA the default leaves the issuing thread a CPU).
    """

    def __init__(self, threads: int | None, device: torch.device):
        self.fixed = None if threads is None else int(threads)  # None: follow the attention's default
        self.device = device
        self.team_cpus: list[int] = []  # the CPU team's CPUs (refresh)
        self._threads = self.fixed  # the count the last refresh or make chose; None: none yet
        self._worker = None
        self._failed = False

    @property
    def threads(self) -> int:
        """OpenMP threads of the running worker, else of the next one made: the fixed count, or
        the attention's default as the last refresh (or the first make) read it; before either,
        as it is now.

        Raises:
            ValueError: a bad ``WRITESCOPE_CPU_THREADS`` (read only when the count follows it).
        """
        return self._threads if self._threads is not None else self._wanted()

    def _wanted(self) -> int:
        """The fixed count, else ``default_attention_threads`` as the environment has it now."""
        return self.fixed if self.fixed is not None else default_attention_threads(self.device)

    def refresh(self, team_cpus: list[int]) -> None:
        """Settings for the next worker: the CPU team's CPUs (the attention worker's,
        ``worker_cpus``), ``WRITESCOPE_CPU_TEAM`` and, where the count is not fixed, the threads
        (``WRITESCOPE_CPU_THREADS``: :attr:`threads`) as they are now; a running worker made
        under others is closed (made again on its next use). Called when a policy is set (a bench
        row's switches, applied around it), not on every layer.

        Raises:
            ValueError: a bad ``WRITESCOPE_CPU_THREADS`` (nothing changed then).
        """
        threads = self._wanted()
        self.team_cpus, self._threads = list(team_cpus), threads
        w = self._worker
        if w is not None and ((w.team is not None) != team_wanted() or (w.team is not None and w.team.cpus != self.team_cpus)
                              or w.threads != threads):
            self.close()

    def get(self):
        """The worker, made on first use and again after a close (a job that did not finish after
        an error closes it: ``forward_into``); None where it cannot start."""
        if self._worker is not None and self._worker.closed:
            self._worker = None
        if self._worker is None and not self._failed:
            try:
                from writescope.moe import cpu_experts
                from writescope.moe.expert_worker import ExpertWorker
                from writescope.native.team import engine_team

                if self._threads is None:  # made before any refresh: the count as it is now, kept until one
                    self._threads = self._wanted()
                team = engine_team(cpu_experts._extension(), self.team_cpus)  # one thread with the CPU attention worker
                self._worker = ExpertWorker(self._threads, self.device, team=team)
            except Exception as e:  # noqa: BLE001 - no Triton, a failed build: the old path
                self._failed = True
                warnings.warn(f"native expert worker unavailable ({e}); host experts run on the issuing thread", stacklevel=3)
        return self._worker

    @property
    def running(self):
        """The worker if it has started, else None (does not start it)."""
        return self._worker

    def close(self) -> None:
        """Finish the queued jobs and stop the worker (made again on the next use).

        Raises:
            RuntimeError: a job failed.
        """
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()


def partition(ids: torch.Tensor, slot_of: torch.Tensor, hosted: int, share: float,
              min_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a layer's hit host experts between the link and the CPU, on ids' device (no host wait).

    Args:
        ids: ``[T, K]`` int64 routed expert ids.
        slot_of: ``[E]`` int64, each expert's slot in the host pack (``hosted`` for device experts).
        hosted: host pack slots (experts in host memory).
        share: in [0, 1], the share of the hit host experts below ``min_tokens`` tokens the link
            takes, most tokens first, ties to the lower id (rounded half to even, as Python's round);
            a float, or a 0-dim float64 tensor on ids' device (a captured pass reads it when it runs).
        min_tokens: host experts with at least this many tokens go to the link whatever ``share``
            (None: none).

    Returns:
        ``(cpu_slot [T, K] int32, link_slot_of [E] int64)``: the host pack slot of each assignment
        the CPU computes (-1 for the others), and ``slot_of`` with the CPU's experts moved to
        ``hosted`` (skipped by the fused kernels), so the two read disjoint experts.
    """
    E = slot_of.shape[0]
    flat = ids.flatten()
    counts = torch.zeros(E, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))  # bincount syncs on CUDA
    hit = (counts > 0) & (slot_of < hosted)
    big = hit & (counts >= min_tokens) if min_tokens is not None else torch.zeros_like(hit)
    small = hit & ~big
    e = torch.arange(E, device=ids.device)
    score = torch.where(small, counts * (E + 1) + (E - e), 0)  # more tokens first, then the lower id; 0 outside
    rank = torch.empty_like(e).scatter_(0, torch.argsort(score, descending=True), e)
    k = torch.round(small.sum().double() * (share if isinstance(share, torch.Tensor) else float(share)))  # float64: the product Python's round sees
    cpu = small & (rank >= k)
    cpu_slot = torch.where(cpu[flat], slot_of[flat], -1).view(ids.shape).to(torch.int32)
    return cpu_slot, torch.where(cpu, hosted, slot_of)


def _reference_into(block, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, take: torch.Tensor,
                    out: torch.Tensor) -> None:
    """Experts ``take`` (``[E]`` bool) of the block by torch's GEMMs into ``out`` (fp32): the
    stand-in for the fused kernels where there is no CUDA (reads the routing on the host)."""
    for e in take.nonzero().flatten().tolist():
        tok, k = (ids == e).nonzero(as_tuple=True)
        y = block.experts[e](x[tok])
        out.index_add_(0, tok, y.to(out.dtype) * weights[tok, k, None].to(out.dtype))


def observe_done(block, worker) -> None:
    """The worker's jobs finished since the last call into the block's joint roofline's E (they
    finish after their layer was issued), and a finished in-step timing of the link's host experts
    into its G (moe/link_timing.py); nothing without one."""
    work = block.expert_work
    if work is not None:
        for secs, nbytes, _ in worker.take_done():
            work.observe(secs, nbytes)
        timer = getattr(work, "link_timer", None)
        # not inside a capture: querying an event there invalidates it (each replay's hand-over calls this again)
        timed = timer.collect() if timer is not None and not replay_hooks.capturing() else None
        if timed is not None:
            work.observe_link(*timed)


def _link_timer(block, share):
    """The joint roofline's link timer if this decode layer step's link share is timed (a float
    share above 0, and the timer's turn: moe/link_timing.py), else None."""
    work = block.expert_work
    timer = getattr(work, "link_timer", None)
    if timer is None or not isinstance(share, float) or not share > 0 or not work.decoding():
        return None
    probe, work.probing = work.probing, False
    return timer if timer.wants(force=probe) else None


def _split_into(block, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, share, bufs: tuple) -> tuple:
    """The split (:func:`partition`) made on x's device and the CPU's inputs copied into the
    worker's buffers ``bufs`` on the current stream (the last job's buffers are free once the
    stream has waited for its done flag and copied its y, which it did before these copies: one
    stream, in order). Returns ``(slot_of, link_slot_of, device views of the host pack or None)``."""
    pack = block.host_pack
    views = block._host_device_views(x.device) if x.device.type == "cuda" else None
    slot_of = pack.slot_of if views is None else views[2]
    cpu_slot, link_slot_of = partition(ids, slot_of, len(pack.ids), share, block.stream_min_tokens)
    xh, sh, rh, _ = bufs
    cuda = views is not None
    xh.copy_(x, non_blocking=cuda)
    sh.copy_(cpu_slot, non_blocking=cuda)
    rh.copy_(weights, non_blocking=cuda)
    return slot_of, link_slot_of, views


def _rest_into(block, x, weights, ids, slot_of, link_slot_of, views, out, timer=None) -> None:
    """The device experts and the link's host experts into ``out``: the fused kernels with CUDA
    (host experts read in place; ``timer``, a LinkTimer or None, times the link's), torch's GEMMs
    without (the reference)."""
    if views is not None:
        if block.packed is not None:
            block.packed(x, weights, ids, out)
        start = None if timer is None else timer.start(link_expert_count(ids, link_slot_of, len(block.host_pack.ids)))
        fused_decode.fused_experts_into(x, weights, ids, link_slot_of, views[0], views[1], block.cfg.intermediate_size, out)
        if start is not None:
            timer.finish(start, block.host_pack.expert_nbytes)
    else:
        hosted = len(block.host_pack.ids)
        _reference_into(block, x, weights, ids, (link_slot_of < hosted) | (slot_of >= hosted), out)


def forward_into(block, worker, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, share: float,
                 out: torch.Tensor) -> int:
    """Every routed expert of ``block`` for tokens ``x`` ``[T, D]`` added into ``out`` ``[T, D]``
    fp32 (shared experts not included), the host experts split by ``share`` (:func:`partition`)
    between ``worker`` (an ``ExpertWorker``) and the link. Returns the worker's job number."""
    if x.shape[0] == 0:  # no tokens: no job (an empty pinned tensor is not pinned)
        return 0
    bufs = worker.buffers(x.shape[0], ids.shape[1], x.shape[1], x.dtype)
    slot_of, link_slot_of, views = _split_into(block, x, weights, ids, share, bufs)
    seq = worker.submit_buffers(bufs, block.host_pack.w13, block.host_pack.w2)
    timer = _link_timer(block, share) if views is not None else None
    try:
        _rest_into(block, x, weights, ids, slot_of, link_slot_of, views, out, timer)
    except BaseException:  # the job still runs: its buffers are free for the next copies only after its done flag
        if timer is not None:
            timer.drop()
        if not worker.wait_host(seq):
            worker.close()  # it did not finish: no later job may reuse its buffers
        raise
    worker.consume(seq)  # with CUDA the stream waits for the done flag, not this thread
    _add_output(worker, bufs, out, views is not None, output_in_place())
    return seq


def captured_into(block, worker, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`forward_into` inside a stage's CUDA graph capture: the device work is
    captured, and the host's part, handing the worker its job, is registered to run before each
    replay (engine/replay_hooks.py), since the graph cannot hold it:

    - each replay first: the share of the pass (the joint roofline's, as eagerly) into the block's
      share tensor (a fill only when it changes), the worker's finished jobs into the roofline's E,
      the job posted to the worker (its inputs not yet ready) and its number written into a pinned
      job slot of this graph (native/flag_worker.py ``JobSlot``);
    - the graph: the split read from the share tensor, the CPU's inputs copied into the worker's
      pinned buffers for this shape (fixed addresses: the hook holds them), the ready flag set to
      the slot's job, the device experts and the link's host experts, a wait for the slot's job's
      done flag, and its sum added into ``out``.
    Nothing runs on the worker at the capture itself. Without CUDA: the tests' stand-in for a
    capture (tests/test_graph_experts.py).
    """
    T, K = ids.shape
    hand = replay_hooks.on_replay(_Handover(block, worker, worker.buffers(T, K, x.shape[1], x.dtype), worker.job_slot(), T))
    slot_of, link_slot_of, views = _split_into(block, x, weights, ids, block.share_tensor(x.device), hand.bufs)
    worker.mark_ready(hand.slot)
    _rest_into(block, x, weights, ids, slot_of, link_slot_of, views, out)
    worker.consume_slot(hand.slot)
    _add_output(worker, hand.bufs, out, views is not None, output_in_place())


class _Handover:
    """The host's part of each replay of a :func:`captured_into` capture (see there): the share,
    E's observations, the job posted and its number in the graph's slot. Holds the pinned
    buffers and the slot whose addresses the graph reads."""

    def __init__(self, block, worker, bufs: tuple, slot, tokens: int):
        self.block, self.worker, self.bufs, self.slot, self.tokens = block, worker, bufs, slot, tokens

    def __call__(self) -> None:
        block, worker = self.block, self.worker
        block.share_tensor(block.gate.weight.device, block.share_of_pass(self.tokens))
        observe_done(block, worker)
        self.slot.free()
        self.slot.set(worker.post_buffers(self.bufs, block.host_pack.w13, block.host_pack.w2))

    def cancel(self) -> None:
        """The graph was not replayed after this call: the job runs now on the buffers as they
        are (its output is not read), so it and the team's jobs behind it do not wait for inputs."""
        self.worker.release(self.slot)
