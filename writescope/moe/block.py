"""The sparse MoE block: router + routed experts (+ shared experts for DeepSeek-V2).

Shape legend: T tokens, D hidden, E routed experts, K top-k, I expert intermediate size.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from writescope.config import MoEConfig
from writescope.engine.ranges import named
from writescope.engine.threads import intra_op_threads
from writescope.layers.mlp import GatedMLP
from writescope.kvcache.pinned import device_view
from writescope.engine import replay_hooks
from writescope.moe import async_experts, cpu_experts, fused_decode
from writescope.moe.grouped import PackedExperts, grouped_mm_supported
from writescope.moe.streaming import MIN_TOKENS, run_streamed
from writescope.moe.router import route


class SparseMoeBlock(nn.Module):
    """y = Σ_k w_k · expert_{id_k}(x) (+ shared_experts(x)).

    Parameter names follow the checkpoints: ``gate.weight`` ``[E, D]``,
    ``experts.{e}.{gate,up,down}`` (Mixtral: ``w1, w3, w2``), ``shared_experts.*``
    (DeepSeek-V2, intermediate ``I · n_shared_experts``).
    """

    def __init__(self, cfg: MoEConfig, hidden: int, deepseek: bool):
        super().__init__()
        self.cfg, self.deepseek = cfg, deepseek
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, cfg.intermediate_size, cfg.expert_names) for _ in range(cfg.num_experts))
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(hidden, cfg.intermediate_size * cfg.n_shared_experts)
        self.host_experts: frozenset[int] = frozenset()
        self.packed: PackedExperts | None = None  # device experts for the grouped path (see pack)
        self.grouped = True  # use the grouped path where torch supports it (False: the loop, the reference)
        self.host_threads: int | None = None  # threads for the host experts (None: torch's count)
        self.host_pack: PackedExperts | None = None  # host experts packed (pinned with CUDA), for streaming and the kernel
        # host experts through the C++ kernel (writescope.moe.cpu_experts) for bf16 where it builds; False: torch's GEMMs
        self.host_kernel = True
        self.stream_min_tokens: int | None = MIN_TOKENS  # stream a host expert with this many tokens (None: never)
        # of the host experts below that (decode), the fraction (most tokens first) also streamed while
        # the CPU computes the rest at the same time; LLM sets 1 on CUDA (benchmarks/results/e2e.md, "Expert phase")
        self.stream_share = 0.0
        # the joint roofline's per-step split of the few-token host experts (scheduler/expert_work.py);
        # when set it replaces stream_share (the engine sets it for `--policy writescope`)
        self.expert_work = None
        self.routing_counts: torch.Tensor | None = None  # [E] int64 on the device while a profile records (moe/popularity.py)
        self._host_views: tuple | None = None  # (w13, w2, slot_of) of the host pack as device tensors (reads in place)
        # the native expert worker shared by the model's blocks (moe/async_experts.py; the engine sets it):
        # a decode pass that splits its host experts computes the CPU's share there, off the issuing thread
        self.expert_worker: async_experts.WorkerHandle | None = None
        self._share_dev: torch.Tensor | None = None  # the share a captured pass reads (share_tensor)
        self._share_last = 0.0
        # the share of the hit host experts the link read in the last pass issued (1 read in place, the worker
        # path's share, the old path's streamed part), None before one: the meter of O keys its steps by it
        # (scheduler/other_work.expert_path). A captured stage sets it from its replay hooks (the job's hand-over,
        # or _note_in_place).
        self.link_share_last: float | None = None

    def graph_key(self, tokens: int | None = None):
        """What a CUDA graph of this block at ``tokens`` tokens depends on beyond shapes: the kernel
        choice, the packed device experts and, read in place, the host pack and its slot table on
        the device (a graph reads addresses, not objects); None when a pass reads routing back to
        the host (host experts computed or streamed, the loop, no pack yet) or a popularity profile
        records, so it cannot be captured (models/graphs.py)."""
        if self.routing_counts is not None or not self.grouped:
            return None
        w = self.gate.weight
        in_place = self._in_place_for(w.dtype, w.device, tokens)
        if self.host_experts and not in_place:
            return self._async_graph_key(tokens)
        if self.packed is None and not in_place:
            return None
        p = self.packed
        # the kernels' choice too: a stage captured with one is never replayed for the other
        key = (fused_decode.env_fused(),) + (() if p is None else (p.w13.data_ptr(), p.w2.data_ptr(), p.slot_of.data_ptr(), tuple(p.ids)))
        if in_place:
            w13, w2, slot_of = self._host_device_views(w.device)
            key += (w13.data_ptr(), w2.data_ptr(), slot_of.data_ptr(), tuple(self.host_pack.ids))
        return key

    def _async_graph_key(self, tokens: int | None):
        """:meth:`graph_key` of a pass whose CPU share goes to the native expert worker, captured
        with its job's hand-over (moe/async_experts.py, ``captured_into``), or None: not wanted
        (``WRITESCOPE_GRAPH_EXPERTS``), not that path, no worker running yet (the first pass starts
        it eagerly) or not CUDA. The graph reads the worker's flags and this block's host pack and
        device experts by address."""
        w = self.gate.weight
        if tokens is None or not async_experts.graph_wanted():
            return None
        worker = None if self.expert_worker is None else self.expert_worker.running
        if worker is None or worker.closed or not self.takes_async(w.dtype, w.device, tokens):
            return None
        p, h = self.packed, self.host_pack
        slot_of = self._host_device_views(w.device)[2] if w.device.type == "cuda" else h.slot_of
        self.share_tensor(w.device)  # made here, before a capture: made inside one, each replay would zero it
        return ((async_experts.GRAPH_KEY_MARK, fused_decode.env_fused(), async_experts.output_in_place(), worker.flags.data_ptr(),
                 self.stream_min_tokens, h.w13.data_ptr(),
                 h.w2.data_ptr(), slot_of.data_ptr(), tuple(h.ids))
                + (() if p is None else (p.w13.data_ptr(), p.w2.data_ptr(), p.slot_of.data_ptr(), tuple(p.ids))))

    def _host_in_place_configured(self, tokens: int | None = None) -> bool:
        """Whether decode passes of ``tokens`` tokens (None: unknown) read the hit host experts'
        weights in place, over PCIe, inside the fused kernels (``WRITESCOPE_MOE_KERNEL=fused``):
        only where every hit host expert would be streamed anyway (``stream_share`` 1, streaming
        possible here) and no joint per-step split takes them (none attached, or one that leaves
        passes of fewer than its ``in_place_below`` tokens to the in-place read), so the placement
        policy is unchanged; nothing is read back to the host and nothing is copied."""
        work = self.expert_work
        unsplit = work is None or (tokens is not None and tokens < getattr(work, "in_place_below", 0))
        return (self.host_pack is not None and self.grouped and self.stream_share >= 1.0 and unsplit
                and fused_decode.env_fused() and self.why_not_streamed() is None)

    def reads_host_experts_in_place(self, tokens: int | None = None) -> bool:
        """Whether this block's decode passes of up to ``tokens`` tokens (None: not checked) read
        their hit host experts in place (over PCIe, inside the fused kernels) as it is configured
        now: see :meth:`_in_place_for`. Packs the device experts first where a move dropped the
        pack (as the next forward would), so the answer does not depend on when it is asked."""
        w = self.gate.weight
        if self.grouped and self.packed is None and self.host_experts:
            self.pack()
        return self._in_place_for(w.dtype, w.device, tokens)

    def _in_place_for(self, dtype: torch.dtype, device: torch.device, tokens: int | None) -> bool:
        """Whether a pass of ``tokens`` tokens (None: unknown, decode-sized) takes the in-place
        path: configured, the fused kernels run for this dtype, device and row count, and the
        device experts (if any) are packed."""
        return (bool(self.host_experts) and self._host_in_place_configured(tokens)
                and fused_decode.wanted_for(dtype, device, None if tokens is None else tokens * self.cfg.top_k)
                and (self.packed is not None or len(self.host_experts) == self.cfg.num_experts))

    def _host_device_views(self, device: torch.device) -> tuple:
        if self._host_views is None:
            h = self.host_pack
            self._host_views = (device_view(h.w13, device), device_view(h.w2, device), h.slot_of.to(device))
        return self._host_views

    def offload_experts(self, ids) -> None:
        """Move routed experts ``ids`` to host memory; their tokens are then computed on the CPU
        (docs/DESIGN.md section 6). Experts not named move back to the block's device.

        Raises:
            ValueError: an id outside ``[0, num_experts)``.
        """
        ids = frozenset(int(e) for e in ids)
        bad = sorted(e for e in ids if not 0 <= e < self.cfg.num_experts)
        if bad:
            raise ValueError(f"expert ids {bad[:5]} outside [0, {self.cfg.num_experts})")
        device = self.gate.weight.device
        was_packed, self.packed, self.host_pack, self._host_views = self.packed is not None, None, None, None
        for e, expert in enumerate(self.experts):  # out first, then in: a re-placement never holds both on the device
            if e in ids:
                expert.to("cpu")
        for e, expert in enumerate(self.experts):
            if e not in ids:
                expert.to(device)
        self.host_experts = ids
        if ids:  # one host allocation for all of them (page-locked with CUDA, so they can be streamed)
            self.host_pack = PackedExperts(self.experts, sorted(ids), self.cfg.expert_names, pin=device.type == "cuda")
            if self.host_kernel and self.host_pack.w13.dtype == torch.bfloat16:
                cpu_experts.prepare()  # checks WRITESCOPE_EXPERT_ISA and builds the kernel now, not in the first step
        if was_packed:  # re-pack now: the kept experts are views of the old pack, which is freed once they move
            self.pack()

    def streams_host_experts(self) -> bool:
        """Whether this block can stream its host experts to its device: it has some, a budget left
        room for the streaming slots (``stream_min_tokens`` not None), and grouped GEMMs run here."""
        return bool(self.host_experts) and self.why_not_streamed() is None

    def why_not_streamed(self) -> str | None:
        """Why this block's host experts cannot be streamed to the device its weights are on, in
        words, or None when they can (see :meth:`streams_host_experts`)."""
        w = self.gate.weight
        return self._stream_blocker(w.device, w.dtype, w.shape[1])

    def _stream_blocker(self, device: torch.device, dtype: torch.dtype, hidden: int) -> str | None:
        if self.stream_min_tokens is None:
            return "no room for streaming slots in the budget"
        if self.host_pack is None:
            return "no routed experts in host memory"
        if not grouped_mm_supported(device, dtype, hidden, self.cfg.intermediate_size):
            return "no grouped GEMM for this device and dtype"
        return None

    def _apply(self, fn, recurse=True):
        self.packed = None  # .to(device or dtype) moves the parameters one by one: pack again on the next forward
        self._host_views = None
        return super()._apply(fn, recurse)

    def pack(self) -> bool:
        """Pack the device experts for the grouped GEMM path (done on the first forward if not
        called; ``LLM`` calls it after placing experts; call it again after replacing expert
        parameters by new tensors). Returns whether the grouped path is used:
        False when torch lacks a grouped GEMM for this device, dtype and shape, when ``grouped``
        is off, or when every expert is on the host."""
        w = self.gate.weight
        dev_ids = [e for e in range(self.cfg.num_experts) if e not in self.host_experts]
        if not self.grouped or not dev_ids or not grouped_mm_supported(w.device, self.experts[dev_ids[0]].dtype_of(), w.shape[1], self.cfg.intermediate_size):
            self.packed = None
            return False
        self.packed = None  # the old pack (if any) goes once the experts are views of the new one
        self.packed = PackedExperts(self.experts, dev_ids, self.cfg.expert_names)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, D]`` -> ``[T, D]``, same dtype. Host experts run on the CPU after the device
        experts are issued, so both sides work at once when the device is a GPU."""
        with named("moe.router"):
            weights, ids = route(x, self.gate.weight, self.cfg, self.deepseek)  # [T, K] f32, [T, K]
            if self.routing_counts is not None:  # a popularity profile is recording (on the device, no wait)
                self.routing_counts += torch.bincount(ids.flatten(), minlength=self.cfg.num_experts)
        # [T, D] float32: the experts' outputs summed without a bf16 rounding per addition (the
        # order of CUDA's atomic adds then changes the sum by fp32 rounding, not bf16's)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if not self.grouped:
            self.packed = None
        elif self.packed is None:
            self.pack()
        if self.packed is not None and not self.host_experts:
            with named("moe.device_experts"):
                self.packed(x, weights, ids, out)
            return self._shared(x, out)
        if self._in_place_for(x.dtype, x.device, x.shape[0]):
            self.link_share_last = 1.0
            if replay_hooks.capturing():  # a replay runs no Python: it notes the path through a hook
                replay_hooks.on_replay(self._note_in_place)
            with named("moe.device_experts"):
                if self.packed is not None:
                    self.packed(x, weights, ids, out)  # the same fused kernels (wanted above)
            with named("moe.host_experts_in_place"):
                w13, w2, slot_of = self._host_device_views(x.device)
                fused_decode.fused_experts_into(x, weights, ids, slot_of, w13, w2, self.cfg.intermediate_size, out)
            return self._shared(x, out)
        share = self._async_share(x)
        if share is not None:
            with named("moe.experts_async"):
                self._async_forward(x, weights, ids, share, out)
            return self._shared(x, out)
        return self._split_forward(x, weights, ids, out)

    def _note_in_place(self) -> None:
        """A captured pass that reads every hit host expert in place is replayed: the link read them all."""
        self.link_share_last = 1.0

    def takes_async(self, dtype: torch.dtype, device: torch.device, tokens: int | None = None) -> bool:
        """Whether a pass of ``tokens`` tokens (None: decode-sized, not checked) that splits its
        host experts would compute the CPU's share on the native expert worker, off the issuing
        thread (moe/async_experts.py): a worker attached and wanted (``WRITESCOPE_EXPERT_WORKER``),
        host experts through the C++ kernel, the grouped path, and the rest in the fused kernels
        (with CUDA: wanted for this many rows, the device experts packed) or, without CUDA, at most
        the fused kernels' row limit (the decode sizes)."""
        if self.expert_worker is None or not self.host_experts or not self.grouped or not async_experts.worker_wanted(device):
            return False
        if not self.uses_host_kernel(dtype):
            return False
        rows = None if tokens is None else tokens * self.cfg.top_k
        if device.type == "cuda":
            return fused_decode.wanted_for(dtype, device, rows) and (self.packed is not None or len(self.host_experts) == self.cfg.num_experts)
        return rows is None or rows <= fused_decode.MAX_ROWS

    def _async_share(self, x: torch.Tensor) -> float | None:
        """The share of the few-token hit host experts the link reads in place in this pass when it
        takes the worker path (:meth:`takes_async`), else None (see :meth:`share_of_pass`)."""
        if not self.takes_async(x.dtype, x.device, x.shape[0]):
            return None
        if replay_hooks.capturing():  # no job now: each replay's hand-over chooses (and counts) the share
            return 0.0
        return self.share_of_pass(x.shape[0])

    def share_of_pass(self, tokens: int) -> float:
        """The share of the few-token hit host experts the link reads in place in a worker-path
        pass of ``tokens`` tokens: the joint roofline's choice for a decode step where one is
        attached, else the fixed ``stream_share``; 0 where no streaming slots fit the budget (the
        CPU computes them all, as on the old path)."""
        if self.stream_min_tokens is None:
            self.link_share_last = 0.0
            return 0.0
        share = None if self.expert_work is None else self.expert_work.share_for(tokens, self)
        share = min(1.0, self.stream_share) if share is None else share
        self.link_share_last = share
        return share

    def share_tensor(self, device: torch.device, share: float | None = None) -> torch.Tensor:
        """A 0-dim float64 tensor on ``device`` that a captured pass reads its share from, set to
        ``share`` now (on the current stream, in order with the work around it) unless None or
        what it last was (async_experts.captured_into)."""
        t = self._share_dev
        if t is None or t.device != device:
            if replay_hooks.capturing():
                raise RuntimeError("the share tensor must be made before a capture (graph_key makes it)")
            t = self._share_dev = torch.zeros((), dtype=torch.float64, device=device)
            self._share_last = 0.0
        if share is not None and share != self._share_last:
            t.fill_(share)
            self._share_last = share
        return t

    def _async_forward(self, x, weights, ids, share, out) -> None:
        """The routed experts with the CPU's share on the native worker (moe/async_experts.py)."""
        worker = self.expert_worker.get()
        if worker is None:  # could not start (warned once): the old path, without its shared experts
            self._split_forward(x, weights, ids, out, shared=False)
            return
        async_experts.observe_done(self, worker)  # E, tracked from the worker's finished jobs
        if replay_hooks.capturing():  # the job's hand-over at each replay, the rest in the graph
            async_experts.captured_into(self, worker, x, weights, ids, out)
            return
        async_experts.forward_into(self, worker, x, weights, ids, share, out)

    def _shared(self, x, out):
        """The routed sum ``out`` (float32) plus the shared experts', rounded once to x's dtype."""
        if not self.cfg.n_shared_experts:
            return out.to(x.dtype)
        with named("moe.shared_experts"):
            return (out + self.shared_experts(x)).to(x.dtype)

    def _split_forward(self, x, weights, ids, out, shared: bool = True):
        """Some experts on the host (or no grouped GEMM): device experts issued first, then the
        host experts on the CPU, then their sum moved back. ``shared`` False: returns ``out``
        (float32, the routed experts only)."""
        flat = ids.flatten()  # [T*K]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        token_of = order // self.cfg.top_k  # [T*K] token index of each sorted assignment
        w_sorted = weights.flatten()[order]  # [T*K]
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        host = [e for e in self.host_experts if counts[e]]
        streamed = []
        if host and self._stream_blocker(x.device, x.dtype, x.shape[1]) is None:
            streamed = [e for e in host if counts[e] >= self.stream_min_tokens]
            host = [e for e in host if counts[e] < self.stream_min_tokens]
            if host and (self.expert_work is not None or self.stream_share > 0):  # noqa: SIM102
                # decode: each host expert has few tokens, and both paths read its weights once, the
                # copy over PCIe (55 GB/s) and the CPU (torch's GEMMs 9-27 GB/s measured; the C++
                # kernel 66-81 GB/s, benchmarks/results/cpu_experts_h200.md): split them so both
                # finish together (a fixed stream_share, or the joint roofline's choice this step)
                by_tokens = sorted(host, key=lambda e: (-counts[e], e))
                k = None if self.expert_work is None else self.expert_work.choose([self.host_pack.expert_nbytes] * len(by_tokens))
                if k is None:  # a fixed share (or a prefill under the joint roofline)
                    k = round(min(1.0, self.stream_share) * len(by_tokens))
                streamed, host = streamed + by_tokens[:k], sorted(by_tokens[k:])
        if streamed or host:
            self.link_share_last = len(streamed) / (len(streamed) + len(host))
        if host:  # the host experts' tokens and routing weights, copied once: [n_host, D], [n_host] on the CPU
            with named("moe.tokens_to_host"):
                host_tok = torch.cat([token_of[starts[e] : starts[e + 1]] for e in host])
                x_host = x[host_tok].to("cpu")
                w_host = torch.cat([w_sorted[starts[e] : starts[e + 1]] for e in host]).to("cpu")  # float32
        with named("moe.device_experts"):
            if self.packed is not None:
                self.packed(x, weights, ids, out)
            for e, n in enumerate(counts):
                if n == 0 or e in self.host_experts or self.packed is not None:
                    continue
                tok = token_of[starts[e] : starts[e + 1]]
                y = self.experts[e](x[tok])  # [n, D]
                out.index_add_(0, tok, (y * w_sorted[starts[e] : starts[e + 1], None].to(y.dtype)).to(out.dtype))
        if streamed:  # issued before the CPU starts on the rest: copies and GEMMs run meanwhile
            with named("moe.streamed_experts"):
                run_streamed(self.host_pack, streamed, [token_of[starts[e] : starts[e + 1]] for e in streamed],
                             [w_sorted[starts[e] : starts[e + 1]] for e in streamed], x, out)
        if host:
            with named("moe.host_experts"):
                t0 = time.perf_counter()
                y = self._host_experts(host, [counts[e] for e in host], x_host, w_host)
                if self.expert_work is not None:  # E, tracked: CPU seconds per expert weight byte
                    self.expert_work.observe(time.perf_counter() - t0, len(host) * self.host_pack.expert_nbytes)
            out.index_add_(0, host_tok, y.to(x.device).to(out.dtype))
        return self._shared(x, out) if shared else out

    def uses_host_kernel(self, dtype: torch.dtype) -> bool:
        """Whether host experts of this dtype go through the C++ kernel: ``host_kernel`` on, bf16,
        the kernel builds, and the host pack holds the experts' current weights."""
        if not (self.host_kernel and dtype == torch.bfloat16 and self.host_pack is not None and self.host_pack.w13.dtype == dtype):
            return False
        e = self.host_pack.ids[0]  # experts given new parameters (a reload) are no longer views of the pack
        if getattr(self.experts[e], self.cfg.expert_names[0]).weight.data_ptr() != self.host_pack.w13[0].data_ptr():
            return False
        return cpu_experts.kernel_available()

    def _host_experts(self, host: list[int], sizes: list[int], x_host: torch.Tensor, w_host: torch.Tensor) -> torch.Tensor:
        """Host experts ``host`` on their tokens ``x_host`` ``[n, D]`` (``sizes[i]`` rows each, in
        order) -> ``[n, D]`` weighted by ``w_host`` ``[n]`` float32, on the CPU, x's dtype.
        One kernel call for all of them (each expert's weights read once), else torch's GEMMs one
        expert after another (the reference)."""
        threads = self.host_threads or torch.get_num_threads()
        if self.uses_host_kernel(x_host.dtype):
            slots = [self.host_pack.index[e] for e in host]
            return cpu_experts.host_experts_forward(x_host, sizes, self.host_pack.w13, self.host_pack.w2, slots, w_host, threads)
        with intra_op_threads(threads):  # each GEMM on all threads
            ys = [self.experts[e](xe) for e, xe in zip(host, x_host.split(sizes))]
        return torch.cat(ys) * w_host[:, None].to(x_host.dtype)
