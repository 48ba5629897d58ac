"""One decode step of one layer over a partitioned cache (docs/DESIGN.md section 4).

```
GPU→CPU   q (small, into pinned memory, no host wait)           only if some sequence has compute blocks
CPU       worker thread: waits for q's copy, then (o_c, lse_c) of every sequence over its compute region, in
          place, by one call of the C++ kernel (attention/cpu_kernel.py) into pinned memory
GPU       (o_w, lse_w) over the D-windows, all sequences at once
GPU       load-region runs: copy stream → ping-pong buffer i; compute stream attends buffer i
          while buffer i+1 is filled (events order reuse)
GPU       o = merge((o_w, lse_w), (o_l, lse_l), (o_c, lse_c))
```

The main thread never waits for the device on the way: q goes to pinned memory with an event
that only the worker waits for, and the CPU partial comes back through pinned memory without a
wait, so the main thread issues the window and load-region work, and after the worker is done the
merge and the rest of the layer, while the device still works through what came before. (A
blocking copy would drain the device's queue every layer, so it would sit idle while Python
issues the next kernels, which costs nothing of the kind in a step with no CPU part.)

Without CUDA the same code runs with CPU tensors and no streams (CI).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from writescope.attention import cpu_kernel, gpu_kernel
from writescope.attention.gpu_decode import GpuDecode
from writescope.attention.merge import merge_segments, merge_unchecked
from writescope.attention.partial import attend_blocks, block_partials, cpu_attend
from writescope.engine.ranges import named
from writescope.engine.threads import default_attention_threads, intra_op_threads
from writescope.engine.timing import stamp
from writescope.env import env_choice
from writescope.kvcache.pinned import device_view, host_empty, unpin
from writescope.kvcache.spec import PartitionSpec

IN_PLACE_RUN = 1 << 20  # load blocks per run read in place: no ring to fit, so a whole slab per launch


@dataclass
class SplitStats:
    """Running totals of decode split attention (seconds, tokens, bytes)."""

    layer_steps: int = 0
    cpu_seconds: float = 0.0  # wall time of the CPU worker's attention
    cpu_tokens: int = 0  # compute-region tokens attended on the CPU
    cpu_parts: int = 0  # CPU parts done (one per decode call with compute blocks)
    window_tokens: int = 0
    streamed_bytes: int = 0  # load region -> ping-pong
    streamed_copies: int = 0
    early_fills: int = 0  # fills copied at the end of the previous layer (early copies: WRITESCOPE_LOAD_COPIES) and used
    early_fills_wasted: int = 0  # such fills copied again because the layer's runs differed
    last_cpu_seconds: float = 0.0  # of the last decode call (0 when it had no CPU part)
    last_cpu_tokens: int = 0
    prepare_seconds: float = 0.0  # monolithic baseline: re-layout into pinned staging
    prepared_bytes: int = 0
    last_load_tokens: int = 0  # load-region (and prepared) tokens streamed by the last decode call


@dataclass(eq=False)  # compared by identity (InplaceKVCache keeps them in a list it removes from)
class PendingDecode:
    """One layer's decode between :meth:`SplitDecoder.decode_begin` and ``decode_end``."""

    layer: int
    q: torch.Tensor  # [B, q_heads, dk]
    seqs: list
    scale: float
    cpu_rows: list[int]  # sequences with a CPU part
    limits: list[int]  # compute blocks the CPU attends, per sequence
    states: list  # device partials merged at the end (torch path; empty with a Triton plan)
    plan: object  # the Triton StepPlan, or None
    fut: Future | None  # the thread-pool CPU part
    job: tuple | None  # the native worker's (seq, (o, lse))
    q_host: torch.Tensor | None
    q_ready: object
    split: tuple[int, int]  # (CPU tokens, load-region tokens)
    load_done: object = None  # with its own load stream: the event after this layer's load partials


def _own_load_stream() -> bool:
    """``WRITESCOPE_LOAD_STREAM``: where the load region's blocks are attended as their copies land.
    ``compute`` (the default): on the compute stream, between this layer's window partials and its
    wait for the CPU. ``own``: on a stream of their own that starts after q and that the merge waits
    for, so the compute stream never waits there for the link: with two micro-batches one half's
    merge, experts and next q then go on while the other half's blocks are still streaming (CUDA
    with the Triton kernels only; elsewhere as ``compute``).

    Raises:
        ValueError: another value (names it).
    """
    return env_choice("WRITESCOPE_LOAD_STREAM", ("compute", "own")) == "own"


def load_copies_from_env() -> str:
    """``WRITESCOPE_LOAD_COPIES``: when the copies of a layer's first ping-pong fills are issued.
    ``own-layer``: in that layer's decode call. ``early``: at the end of the previous layer's load
    part, before the host issues that layer's other work (routing, experts), so the link fills the
    ring while the host waits on the routing or computes host experts on the CPU (a per-step expert
    split or ``--expert-stream-share 0``); the next layer uses those fills where its runs are the
    same, and copies again where they are not (an eviction between the layers, another
    micro-batch's layer in between). ``auto`` (the default): early in the decode steps whose host
    computes experts on the CPU mid-layer (:attr:`SplitDecoder.early_from`, set by the engine),
    own-layer in the others.

    Why auto: on the H200 (runs 39-40, benchmarks/results/gpu_decode_h200.md) Mixtral-8x7B 4 x 8K,
    16K and 32000 under 32 GiB (the CPU computes about 85 host experts a step) took 497 / 541 /
    607 ms a step with early copies against 545 / 606 / 681 own-layer, while DeepSeek-V2-Lite (no
    expert on the CPU) gained nothing (16 x 8K-32K: 79.4 / 110.4 / 179.9 against 74.1 / 108.8 /
    183.4 ms, within about the spread).

    Raises:
        ValueError: another value (names it).
    """
    return env_choice("WRITESCOPE_LOAD_COPIES", ("auto", "own-layer", "early"))


def _cpu_partial_in_place() -> bool:
    """``WRITESCOPE_CPU_PARTIAL``: how the merge gets the CPU partial (o, lse) the native worker
    wrote into pinned memory. ``in-place`` (the default): the merge kernel reads it there, over
    PCIe, through its device address (unified addressing), with no copy. ``copy``: it is copied to
    the device first; on the H200 that copy waited 0.8 ms per layer behind the load region's
    fills already queued on the host-to-device copy engine (benchmarks/results/gpu_decode_h200.md,
    run 26: the compute stream idle between the CPU's done flag and the merge). CUDA with the
    Triton kernels only; elsewhere as ``copy``.

    Raises:
        ValueError: another value (names it).
    """
    return env_choice("WRITESCOPE_CPU_PARTIAL", ("in-place", "copy")) == "in-place"


def _native_wanted() -> bool:
    """``WRITESCOPE_CPU_WORKER``: ``native`` (the default: the C++ worker, cpu_worker.py) or
    ``python`` (a Python thread pool calling the kernel; the main thread waits for its result).

    Raises:
        ValueError: another value (names it).
    """
    return env_choice("WRITESCOPE_CPU_WORKER", ("native", "python")) == "native"


def _fill_key(fill) -> tuple:
    """What a fill holds: per run its sequence index, host address and blocks (a run of the same
    blocks of the same sequence in the same place is the same data: placed blocks never move)."""
    return tuple((i, src.data_ptr(), src.shape[0]) for i, src in fill)


class SplitDecoder:
    """Runs :meth:`decode` for one layer of a batch of :class:`~writescope.kvcache.sequence.SequenceKV`.

    Args:
        spec: cache layout (block shape, ping-pong sizes).
        device: the GPU (or the CPU standing in for it).
        cpu_threads: threads the CPU attention may use (default:
            :func:`writescope.engine.threads.default_attention_threads`).
        cpu_inline: run the CPU attention on the calling thread after issuing the GPU work
            (which then runs asynchronously), instead of in a worker thread started first.
    """

    def __init__(self, spec: PartitionSpec, device: torch.device, cpu_threads: int | None = None, cpu_inline: bool = False):
        self.spec, self.device, self.cpu_inline = spec, device, cpu_inline
        self.cuda = device.type == "cuda"
        self._index = (device.index if device.index is not None else torch.cuda.current_device()) if self.cuda else None
        self.cpu_threads = cpu_threads or default_attention_threads(device)
        # the worker sets its own intra-op thread count (OpenMP settings are per thread)
        self.pool = ThreadPoolExecutor(1, "writescope-cpu-attn", initializer=torch.set_num_threads, initargs=(self.cpu_threads,))
        self._stats = SplitStats()
        self.worker = None  # the native worker (cpu_worker.py), made on first use; None: the thread pool
        self._native = _native_wanted() and not cpu_inline
        self._py_cpu = (0.0, 0, 0)  # CPU seconds, tokens and parts of the thread-pool path (the worker counts its own)
        self._cpu_parts: list[tuple[float, int, int]] = []  # finished CPU parts not yet taken (take_cpu_parts)
        self._buffers: list[torch.Tensor] = []
        self._stage: list[torch.Tensor | None] = [None, None]  # monolithic prepare buffers (pinned)
        self._stage_events: list[object | None] = [None, None]
        self._free_events: list[object | None] = []  # per ping-pong buffer: recorded after its fill's attention
        self._ready_events: list[object] = []  # per ping-pong buffer: recorded after its fill's copies
        self.last_split = (0, 0)  # (CPU tokens, load-region tokens) of the last decode call
        # tokens of the next layer's load region whose copies the last decode call issued early (_copy_early): the
        # link's work during this layer's expert phase (scheduler/expert_work.py)
        self.last_early_tokens = 0
        self.time_gpu = False  # time the GPU part of each call (calibration; see last_gpu_seconds)
        self.gpu_timers: list | None = None  # with time_gpu: (GPU-part timer, had a CPU part) of every call (bench rows)
        # a list: (start, end, bytes) of every ping-pong fill's copies, stamped on the copy stream after the fill's
        # wait for its buffer (bench rows: the link's rate inside decode steps, under whatever else reads host memory)
        self.copy_timers: list | None = None
        self._gpu_timer: object = 0.0
        self._gpu_timer_done = True
        # the Triton launches of the GPU side (gpu_decode.py); None: the plain-torch partials
        self.gpu = GpuDecode(spec, device) if gpu_kernel.available(device, spec.dtype) else None
        self._load_written = True  # the load region was written on the compute stream since the copy stream last waited
        self._evicted = True  # an eviction to the load region was issued since the copy stream last waited for them
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
        # the load partials on a stream of their own (WRITESCOPE_LOAD_STREAM=own; with a Triton plan only)
        self.load_stream = torch.cuda.Stream(device) if self.cuda and _own_load_stream() else None
        self.partial_in_place = self.cuda and _cpu_partial_in_place()  # the merge reads the worker's pinned (o, lse) where they lie
        self._read_in_place: deque = deque()  # (event after the merge, the pinned partial it reads): kept alive until then
        self._load_done = None  # the last decode_begin's load_done event
        self.in_place = spec.load_read == "in-place"  # the load region read where it lies (no ping-pong buffers)
        # early copies (WRITESCOPE_LOAD_COPIES early, or auto from early_from): the next layer's first fills copied
        # at the end of this one's load part; _early is (layer, sequence ids, per fill: its runs' identity) of the
        # fills in the buffers. The switch is read (and a bad value refused) whatever the load read.
        copies_mode = load_copies_from_env()
        self.copies_mode = "own-layer" if self.in_place else copies_mode
        # copies_mode auto: the fewest tokens a decode step at which its host computes experts on the CPU
        # mid-layer (the engine sets it from the expert path; None: never), the steps that copy early
        self.early_from: int | None = None
        self._early = None
        self.grouped = False  # this decode pass runs as two micro-batches (set by the cache's decode_groups): no early copies
        self._stage_views: list[torch.Tensor | None] = [None, None]  # in place: CUDA views of the prepare buffers

    @property
    def copies_early(self) -> bool:
        """Whether some decode steps copy their layers' first fills early (``WRITESCOPE_LOAD_COPIES``
        early, or auto with :attr:`early_from` set)."""
        return self.copies_mode == "early" or (self.copies_mode == "auto" and self.early_from is not None)

    def _copies_early_at(self, tokens: int) -> bool:
        """Whether a decode call of ``tokens`` sequences copies the next layer's first fills early."""
        if self.copies_mode == "auto":
            return self.early_from is not None and tokens >= self.early_from
        return self.copies_mode == "early"

    def _current(self):
        """The current CUDA stream of this thread on the decoder's device (by its index: a device
        object costs a lookup per call, several per layer)."""
        return torch.cuda.current_stream(self._index)

    def warm_up(self, q_heads: int) -> None:
        """Compile the GPU side's Triton kernels for queries of ``q_heads`` heads now (the engine
        calls this when it makes the cache), not inside the first decode step."""
        if self.gpu is not None:
            self.gpu.warm_up(q_heads, self.spec.dtype)

    def note_load_write(self) -> None:
        """The cache wrote load-region blocks on the compute stream (prefill): the next streaming
        copies wait for that stream once. Otherwise they wait only for the ping-pong buffer they
        reuse, so the next layer's blocks stream while this layer still computes."""
        self._load_written = True

    def note_evict(self) -> None:
        """The cache issued an eviction into the load region on its evict stream: the next
        streaming copies wait for that stream once."""
        self._evicted = True

    @property
    def stats(self) -> SplitStats:
        """Running totals; ``last_cpu_seconds`` / ``last_cpu_tokens``: the last CPU part finished
        and not yet reported (with the native worker a layer's CPU part may still run when
        :meth:`decode` returns: it is reported by a later read), else 0."""
        if self.worker is not None:
            for secs, keys, batch in self.worker.take_done():
                self._cpu_parts.append((secs, keys, batch))
                self._stats.last_cpu_seconds, self._stats.last_cpu_tokens = secs, keys
            jobs, secs, keys = self.worker.totals()
            self._stats.cpu_seconds, self._stats.cpu_tokens = self._py_cpu[0] + secs, self._py_cpu[1] + keys
            self._stats.cpu_parts = self._py_cpu[2] + jobs
        return self._stats

    def take_cpu_parts(self) -> list[tuple[float, int, int]]:
        """``(seconds, tokens, batch)`` of every CPU part finished since the last call, each once
        (the online estimate of A observes them; with the native worker a layer's part may finish
        after its decode call returned)."""
        self.stats  # noqa: B018 - polls the worker
        parts, self._cpu_parts = self._cpu_parts, []
        return parts

    def close(self) -> None:
        try:
            if self.cuda:
                torch.cuda.synchronize(self.device)  # queued jobs get their q before the worker stops
            if self.worker is not None:
                worker, self.worker = self.worker, None
                worker.close()
        finally:
            self.pool.shutdown(wait=True)
            for t in self._stage:
                if t is not None:
                    unpin(t)
            self._stage, self._stage_views = [None, None], [None, None]
            self._read_in_place.clear()  # synchronised above: every merge has read its partial
            if self.gpu is not None:
                self.gpu.forget()

    def buffers(self) -> list[torch.Tensor]:
        """The ping-pong buffers ``[pingpong_blocks, parts, kv_heads, D, dim]``, made on first use."""
        if not self._buffers:
            s = self.spec
            self._buffers = [
                torch.empty((s.pingpong_blocks, *s.block_shape()), dtype=s.dtype, device=self.device) for _ in range(s.pingpong_buffers)
            ]
            self._free_events = [None] * s.pingpong_buffers
            if self.cuda:
                self._ready_events = [torch.cuda.Event() for _ in range(s.pingpong_buffers)]
        return self._buffers

    # ------------------------------------------------------------------ one layer
    def decode(self, layer: int, q: torch.Tensor, seqs: list, scale: float, evict_stream=None, cpu_blocks=None) -> torch.Tensor:
        """Exact attention of one new query per sequence over all four regions:
        :meth:`decode_end` of :meth:`decode_begin` (same arguments, returns, errors)."""
        return self.decode_end(self.decode_begin(layer, q, seqs, scale, evict_stream, cpu_blocks))

    def decode_begin(self, layer: int, q: torch.Tensor, seqs: list, scale: float, evict_stream=None, cpu_blocks=None) -> "PendingDecode":
        """Issue one layer's decode attention: the CPU part queued (q to host), the window and
        load-region partials issued on the device. :meth:`decode_end` merges them; between the
        two the caller may issue other work (another micro-batch's layer), which the device runs
        while the CPU attends.

        Args:
            layer: layer id.
            q: ``[B, q_heads, dk]`` on the device.
            seqs: B SequenceKV, each with the new token already in its D-window.
            scale: softmax scale.
            evict_stream: CUDA stream that evictions run on (streaming waits for it).
            cpu_blocks: the ``monolithic`` baseline: per sequence, how many compute-region
                blocks the CPU attends; the rest are re-laid out into pinned staging this step
                (timed in ``stats.prepare_seconds``) and streamed like load blocks. None: the CPU
                attends the whole compute region (the InplaceKVCache format).

        Returns:
            the handle for :meth:`decode_end`, which returns ``[B, q_heads, dv]`` in q's dtype.
        """
        s = self.spec
        B, Hq, dk = q.shape
        Hkv = s.layout.kv_heads
        qg = q.view(B, Hkv, Hq // Hkv, dk)
        self._stats.layer_steps += 1
        self._stats.last_cpu_seconds, self._stats.last_cpu_tokens = 0.0, 0
        self.last_early_tokens = 0
        if self._early is not None and self._early[0] != layer:  # copied early for a layer that is not this one
            self._stats.early_fills_wasted += len(self._early[2])
            self._early = None
        self._gpu_timer_done = False
        limits = [sq.n_comp[layer] if cpu_blocks is None else cpu_blocks[i] for i, sq in enumerate(seqs)]
        cpu_rows = [i for i in range(B) if limits[i] > 0]
        with named("kv.drain"):
            for sq in seqs:  # the newest compute block may still sit in pinned staging: write it home first
                sq.drain(layer)
        fut: Future | None = None
        q_host, q_ready, job = None, None, None
        if cpu_rows and self._use_worker(qg):
            with named("attn.q_to_host"):
                job = self._submit(layer, qg, seqs, cpu_rows, limits, scale)
        elif cpu_rows:
            with named("attn.q_to_host"):
                q_host, q_ready = self._to_host(qg)
        if cpu_rows and job is None and not self.cpu_inline:
            fut = self.pool.submit(self._cpu_part, layer, q_host, seqs, cpu_rows, limits, scale, q_ready)
        fast = self.gpu is not None and q.dtype == s.dtype
        plan = None
        try:
            if self.time_gpu:  # after q's copy to the host was issued: the device part only
                self._gpu_timer = self._start_gpu_timer()
            table = None
            if self.in_place:  # slab runs as CUDA views of the pinned bytes, no copies; with Triton one launch for them all
                table = [(i, t, lo, hi) for i, sq in enumerate(seqs) for t, lo, hi in sq.load_slab_runs(sq.n_load[layer], self.device)]
                sources = [(i, t[layer, lo:hi]) for i, t, lo, hi in table]
            else:
                sources = self._load_sources(layer, seqs)
            prepared = []
            if cpu_blocks is not None:
                with named("attn.monolithic_prepare"):
                    prepared = self._prepare(layer, seqs, limits)
            sources += prepared
            with named("attn.window"):
                if fast:
                    plan = self.gpu.step_plan(layer, qg, seqs, [(i, src.shape[0]) for i, src in sources],
                                              None if table is None or prepared else table)
                    self.gpu.windows(plan, layer, qg, seqs, scale)
                    self._stats.window_tokens += plan.window_tokens
                    states = []
                else:
                    states = [self._window_part(layer, qg, seqs, scale)]
            if sources:
                with named("attn.load_region"):
                    part = self._load_part(qg, sources, scale, evict_stream, plan, layer, None if prepared else seqs)
                    if part is not None:
                        states.append(part)
            self._stats.last_load_tokens = sum(src.shape[0] for _, src in sources) * s.window
            # this call's KV split in tokens (CPU, load region), known on the host: the joint
            # roofline's per-step expert split reads it (scheduler/expert_work.py) after decode_end
            split = (sum(limits[i] for i in cpu_rows) * s.window, self._stats.last_load_tokens)
            if self.time_gpu:
                self._gpu_timer, self._gpu_timer_done = self._stop_gpu_timer(self._gpu_timer), True
                if self.gpu_timers is not None:
                    self.gpu_timers.append((self._gpu_timer, bool(cpu_rows)))
            if prepared and self.cuda:  # the prepare buffer of this layer's parity is reused once these copies (reads) are done
                ev = torch.cuda.Event()
                ev.record(self._current() if self.in_place else self.copy_stream)
                self._stage_events[layer % 2] = ev
        except BaseException:  # never leave the worker reading a sequence the caller may free after an error,
            self._settle(fut, job, self._load_done)  # and report this error, not one the worker may meet as a consequence
            self._load_done = None
            raise
        load_done, self._load_done = self._load_done, None
        return PendingDecode(layer, q, seqs, scale, cpu_rows, limits, states, plan, fut, job, q_host, q_ready, split, load_done)

    def decode_end(self, p: "PendingDecode") -> torch.Tensor:
        """Merge the partials of a :meth:`decode_begin`: ``[B, q_heads, dv]`` in q's dtype. On
        CUDA the device waits for the CPU part (its done flag), not this thread.

        Raises:
            RuntimeError: the CPU part failed (the worker's error).
        """
        B, Hq, _ = p.q.shape
        states = p.states
        try:
            with named("attn.wait_cpu"):
                if p.job is not None:  # on CUDA the stream waits for the worker's done flag, not this thread
                    seq, (o_c, l_c) = p.job
                    self.worker.consume(seq)
                    if self.partial_in_place and p.plan is not None:  # the merge kernel reads them in pinned memory
                        states.append((device_view(o_c, self.device), device_view(l_c, self.device)))
                    else:
                        states.append((self._to_device(o_c), self._to_device(l_c)))
                cpu_state = p.fut.result() if p.fut is not None else None
            if p.cpu_rows and p.job is None:
                o_c, l_c = cpu_state if cpu_state is not None else self._cpu_part(p.layer, p.q_host, p.seqs, p.cpu_rows, p.limits,
                                                                                 p.scale, p.q_ready)
                states.append((self._to_device(o_c), self._to_device(l_c)))
        except BaseException:
            self._settle(p.fut, p.job, p.load_done)
            raise
        self.last_split = p.split
        if p.load_done is not None:  # the load partials, attended on their own stream
            self._current().wait_event(p.load_done)
        with named("attn.merge"):
            if p.plan is not None:  # one launch: window, load and CPU partials
                out = self.gpu.merge(p.plan, p.q, states[-1] if p.cpu_rows else None)
                if p.job is not None and self.partial_in_place:
                    self._keep_until_read(p.job[1])
                return out
            o, _ = merge_unchecked([st[0] for st in states], [st[1] for st in states])
            return o.view(B, Hq, self.spec.layout.v_dim).to(p.q.dtype)

    def _keep_until_read(self, tensors) -> None:
        """Keep the pinned ``tensors`` (the CPU partial) alive until the merge just issued on the
        current stream has read them: torch's pinned allocator would otherwise lend their bytes to
        the next pinned allocation at once (it knows of copies, not of kernels reading host memory).
        Entries whose merge has completed are let go here, without waiting."""
        ev = torch.cuda.Event()
        ev.record(self._current())
        self._read_in_place.append((ev, tensors))
        while self._read_in_place and self._read_in_place[0][0].query():
            self._read_in_place.popleft()

    def abandon(self, p: "PendingDecode") -> None:
        """A :meth:`decode_begin` whose :meth:`decode_end` will not come (an error elsewhere):
        wait until its CPU part no longer reads the cache (and order the compute stream after its
        load partials, which read q and the ping-pong buffers; early copies are waited for and dropped)."""
        self._settle(p.fut, p.job, p.load_done)
        self.forget_early()

    def _settle(self, fut, job, load_done=None) -> None:
        if load_done is not None:
            self._current().wait_event(load_done)
        if fut is not None:
            wait([fut])
        if job is not None:
            self.worker.wait_host(job[0])

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor to the device without waiting: from pageable memory a copy waits
        for the stream's earlier work, so it goes through a contiguous pinned copy (a strided one,
        such as MLA's partial cut from the 576-wide latent, would be made contiguous in pageable
        memory by the copy; torch's caching host allocator keeps the pinned block until the copy
        is done)."""
        if not self.cuda:
            return t
        if t.is_contiguous() and t.is_pinned():  # the C++ kernel wrote it into pinned memory already
            return t.to(self.device, non_blocking=True)
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t)
        return pinned.to(self.device, non_blocking=True)

    def _to_host(self, t: torch.Tensor):
        """``t`` copied to host memory without waiting: ``(host tensor, event)``; the event (None
        without CUDA) is recorded after the copy, and a reader waits for it before reading."""
        if not self.cuda:
            return t, None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(self._current())
        return host, ev

    def _start_gpu_timer(self):
        return stamp(self.device)

    def _stop_gpu_timer(self, start):
        if not self.cuda:
            return time.perf_counter() - start
        end = torch.cuda.Event(enable_timing=True)  # after the load partials, wherever they ran
        end.record(self.load_stream if self._load_done is not None else self._current())
        return start, end

    def last_gpu_seconds(self) -> float:
        """Seconds the device spent on the last decode call's GPU part (D-window and load
        region, from its first kernel to its last, before the CPU part is merged; kernels are
        launched from Python, so launch gaps count); nan unless ``time_gpu`` is set. On CUDA
        this waits for that part to finish (CUDA events); without CUDA it is its wall time.
        """
        return self.gpu_seconds(self.last_gpu_timer())

    def last_gpu_timer(self):
        """The last decode call's GPU-part timer, to be read later by :meth:`gpu_seconds` (a
        caller timing several layers reads them after one synchronisation, not one per layer)."""
        return self._gpu_timer if self._gpu_timer_done else float("nan")  # nan: the last call stopped early (an error)

    @staticmethod
    def gpu_seconds(timer) -> float:
        """Seconds of a timer from :meth:`last_gpu_timer` (on CUDA: waits for its end event)."""
        if isinstance(timer, tuple):
            timer[1].synchronize()
            return timer[0].elapsed_time(timer[1]) / 1e3
        return timer

    def _prepare(self, layer, seqs, limits):
        """Monolithic baseline: copy the GPU's share of each compute region (per-head rows) into
        a pinned staging buffer in block layout, as a cache with one physical state must do every
        step. Two buffers alternate by layer; one is reused once its copies to the GPU are done."""
        D, s = self.spec.window, self.spec
        runs = [(i, sq.compute[layer, :, :, limits[i] * D : sq.n_comp[layer] * D]) for i, sq in enumerate(seqs) if sq.n_comp[layer] > limits[i]]
        need = sum(r.shape[2] // D for _, r in runs)
        if need == 0:
            return []
        t0 = time.perf_counter()
        slot = layer % 2
        if self._stage_events[slot] is not None:
            self._stage_events[slot].synchronize()
        buf = self._stage[slot]
        if buf is None or buf.shape[0] < need:
            if buf is not None:
                unpin(buf)
            buf = self._stage[slot] = host_empty((need, *s.block_shape()), s.dtype, pin=self.cuda)
            self._stage_views[slot] = None
        src, step = buf, s.pingpong_blocks
        if self.in_place:  # the kernels read the staging buffer itself, one run per sequence
            if self._stage_views[slot] is None:
                self._stage_views[slot] = device_view(buf, self.device)
            src, step = self._stage_views[slot], IN_PLACE_RUN
        out, off = [], 0
        for i, rows in runs:
            nb = rows.shape[2] // D
            buf[off : off + nb].copy_(rows.unflatten(2, (nb, D)).permute(2, 0, 1, 3, 4))
            out += [(i, src[a : min(off + nb, a + step)]) for a in range(off, off + nb, step)]
            off += nb
        self._stats.prepare_seconds += time.perf_counter() - t0
        self._stats.prepared_bytes += off * s.block_bytes
        return out

    def _window_part(self, layer, qg, seqs, scale):
        s = self.spec
        win = torch.stack([sq.window[layer] for sq in seqs])  # [B, parts, Hkv, D, dim]
        lens = torch.tensor([sq.win_len[layer] for sq in seqs], dtype=torch.long)
        self._stats.window_tokens += int(lens.sum())
        k = win[:, 0].unsqueeze(1)  # [B, 1, Hkv, D, dk]
        v = win[:, 1].unsqueeze(1) if s.parts == 2 else k[..., : s.layout.v_dim]
        return attend_blocks(qg, k, v, scale, self._to_device(lens))

    def _load_part(self, qg, sources, scale, evict_stream, plan=None, layer=0, seqs=None):
        """Stream every sequence's load blocks through the ping-pong buffers. Runs of several
        sequences are packed into one buffer fill (one copy per run); each fill yields one
        partial per block, and all blocks are merged per sequence once at the end. With a
        Triton ``plan`` the partials go into the plan's buffers (returns None), else they are
        computed and merged in torch (returns the merged state).

        The copy stream waits for the compute stream only after prefill wrote load blocks, and
        for the evict stream only after an eviction into the load region; otherwise only for
        the buffer it refills, so the next layer's copies start while this one computes."""
        if self.in_place:
            return self._load_in_place(qg, sources, scale, evict_stream, plan, layer)
        s = self.spec
        B = qg.shape[0]
        fills = list(self._fills(sources))
        early_on = seqs is not None and not self.grouped and self._copies_early_at(B)
        seq_ids = tuple(id(sq) for sq in seqs) if early_on else None
        if plan is None:
            ids, q_blk, o_blk, lse_blk = self._torch_blocks(qg, [(i, src.shape[0]) for fill in fills for i, src in fill], scale)
        bufs = self.buffers()
        home = cur = self._current() if self.cuda else None  # home: current again at the end
        own = self.load_stream is not None and plan is not None
        if own:  # the fills' attention on the load stream, after q and the plan (made on the compute stream)
            self.load_stream.wait_stream(cur)
            cur = self.load_stream
        if self.cuda:
            if self._load_written:
                self.copy_stream.wait_stream(cur)  # prefill writes into the load region
                self._load_written = False
            if evict_stream is not None and self._evicted:
                self.copy_stream.wait_stream(evict_stream)  # evicted blocks
                self._evicted = False
        early, self._early = self._early, None  # fills copied at the end of the previous layer, used once or never
        if early is not None and (early[0] != layer or early[1] != seq_ids):
            self._stats.early_fills_wasted += len(early[2])
            early = None
        start = 0
        try:
            if own:
                torch.cuda.set_stream(cur)
            for n, fill in enumerate(fills):
                b = n % len(bufs)
                total = sum(src.shape[0] for _, src in fill)
                buf = bufs[b][:total]
                copied = early is not None and n < len(early[2]) and early[2][n] == _fill_key(fill)
                if early is not None and n < len(early[2]) and not copied:
                    self._stats.early_fills_wasted += 1
                if copied:  # its copies were issued at the end of the previous layer (_copy_early)
                    self._stats.early_fills += 1
                    if self.cuda:
                        cur.wait_event(self._ready_events[b])
                elif self.cuda:
                    cur.wait_event(self._copy_fill(bufs, b, fill, cur))
                else:
                    torch.cat([src for _, src in fill], out=buf)
                self._stats.streamed_bytes += buf.numel() * buf.element_size()
                self._stats.streamed_copies += len(fill)
                if plan is not None:
                    self.gpu.fill(plan, qg, buf, start, scale)  # on cur: the compute stream, or (own) the load stream
                else:
                    k = buf[:, 0]  # [nb, Hkv, D, dk]
                    v = buf[:, 1] if s.parts == 2 else k[..., : s.layout.v_dim]
                    o_blk[start : start + total], lse_blk[start : start + total] = block_partials(q_blk[start : start + total], k, v)
                if self.cuda:
                    if self._free_events[b] is None:
                        self._free_events[b] = torch.cuda.Event()
                    self._free_events[b].record(cur)  # re-recorded: the copy stream's wait on it was enqueued above
                start += total
        finally:
            if own:  # decode_end's merge waits for it (after an error part-way, so does abandon)
                torch.cuda.set_stream(home)  # first: the compute stream current again whatever the record does
                self._load_done = torch.cuda.Event()
                self._load_done.record(cur)
        if early_on and layer + 1 < self.spec.num_layers:
            self._copy_early(layer + 1, seqs, seq_ids, bufs, home)
        return None if plan is not None else merge_segments(o_blk, lse_blk, ids, B)

    def _copy_fill(self, bufs, b: int, fill, cur):
        """Issue the copies of ``fill`` into ping-pong buffer ``b`` on the copy stream, after the
        buffer's last reader (its free event); returns the event recorded after them."""
        buf = bufs[b]
        torch.cuda.set_stream(self.copy_stream)  # by hand: a `torch.cuda.stream` block costs tens of us per fill
        try:
            if self._free_events[b] is not None:
                self.copy_stream.wait_event(self._free_events[b])
            timed = stamp(self.device) if self.copy_timers is not None else None  # on the copy stream, after the wait
            off = 0
            for _, src in fill:
                buf[off : off + src.shape[0]].copy_(src, non_blocking=True)
                off += src.shape[0]
            if timed is not None:
                self.copy_timers.append((timed, stamp(self.device), sum(src.numel() * src.element_size() for _, src in fill)))
            ready = self._ready_events[b]  # re-recorded: every wait on it is enqueued before its next record
            ready.record(self.copy_stream)
        finally:
            torch.cuda.set_stream(cur)
        return ready

    def _copy_early(self, layer: int, seqs: list, seq_ids: tuple, bufs, cur) -> None:
        """Early copies (``WRITESCOPE_LOAD_COPIES`` early, or auto in a step of at least
        :attr:`early_from` tokens): copy ``layer``'s first fills (one per ping-pong buffer)
        now, each after its buffer's last reader in this layer, and remember which runs they hold;
        that layer's :meth:`_load_part` uses a fill whose runs are the same and copies the others
        again. Without CUDA the copies are plain (so CI exercises the matching)."""
        if self.cuda and (self._load_written or self._evicted):  # the next load part's copies must first wait for those writes
            return
        sources = self._load_sources(layer, seqs)
        keys = []
        for n, fill in enumerate(self._fills(sources)):
            if n == len(bufs):
                break
            total = sum(src.shape[0] for _, src in fill)
            if self.cuda:
                self._copy_fill(bufs, n, fill, cur)
            else:
                torch.cat([src for _, src in fill], out=bufs[n][:total])
            self.last_early_tokens += total * self.spec.window
            keys.append(_fill_key(fill))
        if keys:
            self._early = (layer, seq_ids, keys)

    def forget_early(self) -> None:
        """Drop the early fills (their buffers hold nothing the next call may use): after a failed
        step, before the sequences whose blocks they copied are freed (their copies are waited for)."""
        if self._early is not None:
            if self.cuda:
                self.copy_stream.synchronize()
            self._early = None

    def _load_in_place(self, qg, sources, scale, evict_stream, plan=None, layer=0):
        """The load part read where it lies (``WRITESCOPE_LOAD_READ=in-place``): each run of
        ``sources`` is a CUDA view of page-locked host blocks, attended by the same kernels as a
        ping-pong fill, whose loads cross PCIe; with a plan that holds the step's block offsets
        (:meth:`GpuDecode.step_plan`'s ``in_place``), all of them in one launch. Ordered on the
        current stream: after the prefill's writes (same stream) and, once after an eviction into
        the load region, after the evict stream. Returns as :meth:`_load_part`."""
        s = self.spec
        B = qg.shape[0]
        if self.cuda and evict_stream is not None and self._evicted:
            self._current().wait_stream(evict_stream)
            self._evicted = False
        self._load_written = False
        if plan is None:
            ids, q_blk, o_blk, lse_blk = self._torch_blocks(qg, [(i, src.shape[0]) for i, src in sources], scale)
        if plan is not None and plan.load_offs is not None:  # one launch over every sequence's load blocks
            self.gpu.load_in_place(plan, qg, layer, scale)
            self._stats.streamed_bytes += sum(src.numel() * src.element_size() for _, src in sources)
            return None
        start = 0
        for _, src in sources:
            n = src.shape[0]
            if plan is not None:
                self.gpu.fill(plan, qg, src, start, scale)
            else:
                k = src[:, 0]
                v = src[:, 1] if s.parts == 2 else k[..., : s.layout.v_dim]
                o_blk[start : start + n], lse_blk[start : start + n] = block_partials(q_blk[start : start + n], k, v)
            self._stats.streamed_bytes += src.numel() * src.element_size()
            start += n
        return None if plan is not None else merge_segments(o_blk, lse_blk, ids, B)

    def _torch_blocks(self, qg, runs, scale):
        """The plain-torch load part's inputs for ``runs`` ``(sequence index, blocks)`` in order:
        ``(ids [blocks]`` each block's sequence on the device, ``q_blk [blocks, Hkv, G, dk]`` its
        scaled query, and empty partial buffers ``o_blk, lse_blk)`` in the accumulation dtype."""
        s = self.spec
        _, Hkv, G, _ = qg.shape
        ids = self._to_device(torch.repeat_interleave(torch.tensor([i for i, _ in runs], dtype=torch.long),
                                                      torch.tensor([n for _, n in runs], dtype=torch.long)))
        acc = torch.promote_types(s.dtype, torch.float32)
        o_blk = torch.empty(ids.shape[0], Hkv, G, s.layout.v_dim, dtype=acc, device=self.device)
        lse_blk = torch.empty(ids.shape[0], Hkv, G, dtype=acc, device=self.device)
        return ids, (qg.to(acc) * scale).index_select(0, ids), o_blk, lse_blk

    def _load_sources(self, layer: int, seqs: list) -> list:
        """Every sequence's load blocks of ``layer`` as ``(sequence index, run)``, runs of at most one
        ping-pong buffer: what a layer's load part streams (and its early copies copy)."""
        n = self.spec.pingpong_blocks
        return [(i, run) for i, sq in enumerate(seqs) for run in sq.load_runs(layer, 0, sq.n_load[layer], n)]

    def _fills(self, sources):
        """Group runs ``(sequence index, [nb, parts, Hkv, D, dim])`` into buffer fills of at
        most ``pingpong_blocks`` blocks."""
        cap = self.spec.pingpong_blocks
        fill, used = [], 0
        for i, src in sources:
            while src.shape[0] > 0:
                if used == cap:
                    yield fill
                    fill, used = [], 0
                take = min(cap - used, src.shape[0])
                fill.append((i, src[:take]))
                used += take
                src = src[take:]
        if fill:
            yield fill

    def _compute_views(self, layer, seqs, rows, limits):
        """Per sequence the ``(k, v)`` views of its first ``limits[i]`` compute blocks (None for
        the others), and the tokens they hold."""
        kv, tokens = [None] * len(seqs), 0
        for i in rows:
            n = limits[i] * self.spec.window
            k, v = seqs[i].compute_kv(layer)
            kv[i] = (k[:, :n], v[:, :n])
            tokens += n
        return kv, tokens

    def _use_worker(self, qg) -> bool:
        """The native worker takes this layer (the C++ kernel is selected, bf16 or fp32); made on
        first use. False where it cannot start (then the thread pool, with a warning)."""
        if not self._native or not cpu_kernel.kernel_selected() or qg.dtype not in (torch.bfloat16, torch.float32):
            return False
        if self.spec.dtype not in (torch.bfloat16, torch.float32):
            return False
        if self.worker is None:
            try:
                from writescope.attention.cpu_worker import NativeWorker, worker_cpus
                from writescope.native.team import engine_team

                team = engine_team(cpu_kernel._extension(), worker_cpus(self.cpu_threads))  # one thread with the expert worker
                self.worker = NativeWorker(self.cpu_threads, self.device, team=team)
            except Exception as e:  # noqa: BLE001 - no Triton, no kernel, a failed compile: the thread pool
                import warnings

                warnings.warn(f"native CPU attention worker unavailable ({e}); using the thread pool", stacklevel=3)
                self._native = False
                return False
        return True

    def _submit(self, layer, qg, seqs, rows, limits, scale):
        """Queue the layer's CPU part on the native worker: q to pinned memory on the current
        stream (no host wait), the ready flag set behind it, pinned outputs. Returns ``(seq, (o, lse))``."""
        self.worker.check()
        kv, _ = self._compute_views(layer, seqs, rows, limits)
        B, Hkv, G, _ = qg.shape
        q_host = torch.empty(qg.shape, dtype=qg.dtype, pin_memory=self.cuda)
        q_host.copy_(qg, non_blocking=self.cuda)
        out = (torch.empty(B, Hkv, G, self.spec.layout.v_dim, pin_memory=self.cuda), torch.empty(B, Hkv, G, pin_memory=self.cuda))
        seq = self.worker.submit(q_host, kv, scale, out)
        return seq, out

    def _cpu_part(self, layer, q_host, seqs, rows, limits, scale, q_ready=None):
        """Compute-region attention for ``rows`` over their first ``limits[i]`` blocks; others
        get the empty partial. Runs in the worker thread unless ``cpu_inline``. ``q_ready``: the
        event of q's copy to the host (waited for first, outside the timed part)."""
        if q_ready is not None:
            with named("attn.wait_q"):
                q_ready.synchronize()
        with named("attn.cpu_part"):
            return self._cpu_part_body(layer, q_host, seqs, rows, limits, scale)

    def _cpu_part_body(self, layer, q_host, seqs, rows, limits, scale):
        t0 = time.perf_counter()
        kv, tokens = self._compute_views(layer, seqs, rows, limits)
        if cpu_kernel.kernel_selected() and cpu_kernel.usable(q_host, kv):
            # one call for the batch, merged, written straight into pinned memory for the copy to the GPU
            B, Hkv, G, _ = q_host.shape
            out = (torch.empty(B, Hkv, G, self.spec.layout.v_dim, pin_memory=self.cuda), torch.empty(B, Hkv, G, pin_memory=self.cuda))
            o, lse = cpu_kernel.attend(q_host, kv, scale, out=out, threads=self.cpu_threads)
        elif self.cpu_inline:  # the worker sets its thread count once; here, for this call only
            with intra_op_threads(self.cpu_threads):
                o, lse = cpu_attend(q_host, kv, scale, self.spec.layout.v_dim)
        else:
            o, lse = cpu_attend(q_host, kv, scale, self.spec.layout.v_dim)
        dt = time.perf_counter() - t0
        st = self._stats
        self._py_cpu = (self._py_cpu[0] + dt, self._py_cpu[1] + tokens, self._py_cpu[2] + 1)
        self._cpu_parts.append((dt, tokens, len(seqs)))
        st.cpu_seconds += dt
        st.cpu_tokens += tokens
        st.cpu_parts += 1
        st.last_cpu_seconds = dt
        st.last_cpu_tokens = tokens
        return o, lse
