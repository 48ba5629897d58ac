"""``LLM``: the Python API, shaped like vLLM's (``LLM(model).generate(prompts, params)``)."""

from __future__ import annotations

import os
import resource
import time
import warnings
from typing import Sequence

import torch

from writescope.attention import cpu_kernel
from writescope.budget.apply import enforce_budget, host_experts, place_experts
from writescope.budget.memory import available_memory, check_fits, host_memory_total  # noqa: F401 - also imported from here
from writescope.engine.arguments import check_arguments, check_share, check_threads
from writescope.engine.model_loader import load_model
from writescope.errors import ArgError, plural
from writescope.engine.choices import expand_batch, group
from writescope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from writescope.engine.prompts import check_token_ids, token_lists, too_long
from writescope.engine.runner import EngineCore, prefill_batch
from writescope.engine.sampling import SamplingParams
from writescope.engine.streaming import OnTokens, TokenEvent
from writescope.engine.threads import default_attention_threads, default_expert_threads
from writescope.engine.timing import synchronize
from writescope.kvcache.base import KVCache
from writescope.kvcache.contiguous import ContiguousKVCache
from writescope.kvcache.inplace import InplaceKVCache
from writescope.kvcache.spec import DEFAULT_WINDOW, PartitionSpec, Roofline
from writescope.moe.block import SparseMoeBlock
from writescope.moe.streaming import default_stream_share
from writescope.moe.popularity import ExpertProfile
from writescope.scheduler.expert_work import attach_expert_work, detach_expert_work
from writescope.moe.async_experts import WorkerHandle
from writescope.scheduler.calibrate import load_or_calibrate
from writescope.scheduler.other_work import for_engine as other_work_for, in_place_link_seconds
from writescope.scheduler.roofline import WriteScopePolicy
from writescope.scheduler.policies import parse_policy


class LLM:
    """A loaded model and its KV cache, ready to generate.

    Args:
        model: a Hugging Face checkpoint directory or a preset name (presets have synthetic
            weights; see ``writescope.presets``).
        synthetic: use seeded synthetic weights even for a checkpoint directory.
        device: ``auto``, ``cpu`` or ``cuda``.
        dtype: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bf16``, ``fp16``, ``fp32``.
        seed: synthetic-weight seed, and the default sampling seed.
        max_model_len: tokens one request may reach (prompt + new tokens); defaults to the
            config's ``max_position_embeddings``.
        prefill_chunk_tokens: prompt tokens per prefill forward pass (bounds activation memory).
        progress: show progress bars (loading, long prefills).
        policy: KV placement: ``resident`` (all KV on the device), ``gpu`` (spilled KV in the
            pinned load region, streamed every step), ``cpu`` (spilled KV in the compute region,
            attended by the CPU), ``static:R`` (CPU share R in [0, 1]), ``writescope`` (roofline
            share r(L) with A tracked online; calibrates on first use), ``monolithic[:R]`` (the
            one-physical-state baseline). See docs/DESIGN.md section 7.
        window: D, tokens of the D-window and of one block (partitioned policies).
        pinned_budget: bytes of host memory the load region may pin (default: half the host's
            memory).
        cpu_threads: threads for CPU attention (default: torch's intra-op thread count, less one
            with CUDA: see :mod:`writescope.engine.threads`).
        expert_threads: threads for the routed experts in host memory (default: torch's count).
        expert_stream_share: of the host experts with few tokens (decode), the fraction streamed to
            the device each step while the CPU computes the rest, in [0, 1]; 0: the CPU computes
            them all; 1: all streamed. Default: 1 on CUDA (on the H200 the expert phase of a
            16-token step took 1.6-5.3x less time streamed than on the CPU:
            benchmarks/results/e2e.md, "Expert phase"), 0 without CUDA, where there is nothing
            to stream to
            (:attr:`writescope.moe.block.SparseMoeBlock.stream_share`). On CUDA the streamed ones
            are read in place by the fused decode kernels (``WRITESCOPE_MOE_KERNEL``). Not given,
            policy ``writescope`` and no in-place read (``grouped``, fp32, no Triton, or a
            ``max_batch`` beyond the kernels' row limit): the joint roofline splits them each step
            (scheduler/joint.py, scheduler/expert_work.py).
        expert_profile: with ``vram_budget``, which routed experts stay on the device: an
            :class:`~writescope.moe.popularity.ExpertProfile` or the path of one (the most chosen
            of each layer); None: the lowest ids.
        vram_budget: bytes (or a size such as ``"32GiB"``) of device memory the run may use.
            The plan (``writescope plan``) for ``max_batch`` sequences of ``max_model_len``
            tokens is checked before any weight is loaded; routed experts that do not fit are
            built in host memory (never on the device) and computed on the CPU, or streamed to the
            device for long prompts; on CUDA the allocator is capped at the budget for this process.
        max_batch: sequences the budget plan reserves D-windows for (with ``vram_budget``).
        num_layers: keep only the first ``num_layers`` decoder layers of the model's shape
            (synthetic weights only; for benchmarks of one model's layer shape).
        kv_tokens: tokens of KV (prompt + new tokens, summed over the requests) to count beside the
            weights in the memory check made before anything is built
            (:func:`writescope.budget.memory.check_fits`); the CLI passes its requests'. Default 0:
            the weights alone (every ``generate`` checks its batch's KV before allocating it).
        prefill_order: how ``generate``'s prefill runs its passes: ``layer`` (layer by layer over
            groups of passes, earlier KV kept on the device) or ``chunk`` (one pass through every
            layer after another); None: ``WRITESCOPE_PREFILL_ORDER``'s (default ``layer``). Read
            once here: the budget plan counts what it costs (engine/prefill_order.py). A server
            passes ``chunk``: its passes interleave with decode steps, one at a time.

    Raises:
        ValueError: unknown model/preset, bad dtype or device, bad max_model_len, unknown
            policy, a partitioned policy for a model with a sliding window, or a
            ``vram_budget`` the plan refuses, or weights and ``kv_tokens`` of KV beyond the host
            (CPU) or device memory available (both raised before anything is built), or loaded
            weights that already hold the whole budget (raised after loading, before the cap).
        CheckpointError: the checkpoint's tensors do not match the config.
    """

    def __init__(
        self,
        model: str,
        *,
        synthetic: bool = False,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        prefill_chunk_tokens: int = 8192,
        progress: bool = True,
        policy: str = "resident",
        window: int = DEFAULT_WINDOW,
        pinned_budget: int | None = None,
        cpu_threads: int | None = None,
        vram_budget: int | str | None = None,
        max_batch: int = 32,
        num_layers: int | None = None,
        expert_threads: int | None = None,
        expert_stream_share: float | None = None,
        expert_profile=None,
        kv_tokens: int = 0,
        prefill_order: str | None = None,
    ):
        checked = check_arguments(model, synthetic=synthetic, device=device, dtype=dtype, max_model_len=max_model_len,
                                  prefill_chunk_tokens=prefill_chunk_tokens, policy=policy, window=window, cpu_threads=cpu_threads,
                                  vram_budget=vram_budget, max_batch=max_batch, num_layers=num_layers,
                                  expert_threads=expert_threads, expert_stream_share=expert_stream_share,
                                  prefill_order=prefill_order)
        self.prefill_order = checked.prefill_order
        self.device, self.dtype, sizing, cfg = checked.device, checked.dtype, checked.sizing, checked.config
        self.max_model_len, self.vram_plan, self.max_batch = checked.max_model_len, checked.plan, max_batch  # max_batch: the plan's seats
        self.expert_stream_share_given = expert_stream_share  # None: the device's default, and writescope's split each step
        self.expert_stream_share_at_load = expert_stream_share  # what a bench row without its own share runs with
        if expert_stream_share is None:
            expert_stream_share = default_stream_share(self.device)
        check_fits(cfg, self.dtype, self.device, kv_tokens, available_memory(torch.device("cpu")),  # before anything is built
                   available_memory(self.device) if self.device.type == "cuda" else None, self.vram_plan, sizing is None)
        # a bad WRITESCOPE_CPU_ATTENTION fails here; the kernel, if selected, is built before calibration and timing
        self.cpu_attention = cpu_kernel.prepare(progress)
        if isinstance(expert_profile, (str, os.PathLike)):  # which experts stay on the device (moe/popularity.py)
            expert_profile = ExpertProfile.load(expert_profile)
        if expert_profile is not None:
            expert_profile.warn_if_unused(str(model), self.vram_plan is not None)
        self.expert_profile = expert_profile
        on_host = host_experts(cfg, self.vram_plan, expert_profile) if self.vram_plan is not None else None
        self.progress = progress
        self._rooflines: dict[tuple[int, int | None], Roofline] = {}  # (window, cpu_threads) -> calibrated inputs
        roofline = None
        if self.vram_plan is not None and policy.strip().lower() in ("writescope", "monolithic"):
            # calibrate (once per machine and shape) before the weights load: the budget's cap
            # leaves no device memory for the calibration's cache afterwards
            roofline = self._roofline(cfg, window, cpu_threads)
        self.config, self.model, self.tokenizer, self.load_info = load_model(
            model, synthetic, self.dtype, self.device, seed, progress, num_layers, on_host
        )
        if self.vram_plan is not None:
            self.load_info["experts_offloaded"] = place_experts(self.model, self.vram_plan, expert_profile)
        blocks = [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]
        # device experts packed for grouped GEMMs before the budget is enforced (the packing
        # copies one layer's experts at a time)
        packed = [b.pack() for b in blocks]  # False for a block with every expert on the host
        self.load_info["grouped_experts"] = bool(blocks) and all(p or not [e for e in range(b.cfg.num_experts) if e not in b.host_experts]
                                                                 for p, b in zip(packed, blocks))
        self.expert_threads = expert_threads or default_expert_threads(self.device)
        # started on the first pass that uses it; given no expert_threads, as many threads as the attention's
        # default (WRITESCOPE_CPU_THREADS, else on CUDA one CPU fewer than torch's count, left to the thread that
        # issues the step), read again whenever a policy is set (a bench row's switches: set_policy's refresh)
        self.expert_worker = WorkerHandle(expert_threads, self.device)
        for b in blocks:
            b.host_threads = self.expert_threads
            b.expert_worker = self.expert_worker
            b.stream_share = expert_stream_share
            if self.vram_plan is not None and not self.vram_plan.stream_slots:
                b.stream_min_tokens = None  # no room in the budget for streaming slots: host experts stay on the CPU
        self._moe_blocks = blocks
        if self.vram_plan is not None:
            p = self.vram_plan
            self.load_info["device_memory_at_cap"] = enforce_budget(self.device, p.budget, p.weights_gpu, p.working_gpu)
        self.seed = seed
        self.other_work = other_work_for(self.device, self.config, self.dtype, blocks)  # O, for the split gate (kept on CUDA)
        self.other_work.captures = self._graph_captures  # a step that captured graphs measures no O
        self.step_hook = None  # called after every decode step (profilers; see writescope.bench.breakdown)
        self.r_trace: list[dict] | None = None  # the last generate's r(L) trace (partitioned policies)
        self.decode_host: list[tuple[float, float]] = []  # the last generate's (issue, wait) seconds per decode step
        self.prefill_chunks: list[dict] = []  # the last offline prefill's passes, or groups of them run layer by layer (engine/runner.py prefill_batch)
        self.decode_between: list[float] = []  # and the seconds before each, since the last tokens were sampled
        self.release_s = 0.0  # the last generate's seconds from its last token to its return (freeing the finished requests' KV)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.pinned_budget = pinned_budget if pinned_budget is not None else (host_memory_total() or 0) // 2 or None
        self.cache: KVCache = ContiguousKVCache(self.config.kv_layout, self.config.num_layers, self.dtype, self.device)
        self.set_policy(policy, window, cpu_threads, roofline)
        self._next_request_id = 0

    def set_policy(
        self, policy: str, window: int | None = None, cpu_threads: int | None = None, roofline: Roofline | None = None
    ) -> None:
        """Switch the KV placement policy (a new, empty cache; the weights stay loaded).
        ``window`` (D) and ``cpu_threads`` default to the current ones; ``roofline`` overrides
        the calibrated inputs of the ``writescope`` and ``monolithic`` policies. A ``writescope``
        policy's estimate of A starts from the in-step A an earlier one tracked over real decode
        steps with this many CPU attention threads under the switches set now (kept by
        ``other_work``, on CUDA also from earlier processes: scheduler/other_work.py), where there is
        one, whatever ``roofline`` says.

        Raises:
            ValueError: unknown policy, a bad window or cpu_threads, a partitioned policy for a
                model with a sliding window, or requests still holding KV. The old cache stays
                in use then.
        """
        window = window if window is not None else getattr(self, "window", DEFAULT_WINDOW)
        cpu_threads = cpu_threads if cpu_threads is not None else getattr(self, "cpu_threads", None)
        check_threads(cpu_threads)
        is_adaptive = policy.strip().lower() in ("writescope", "monolithic")
        if is_adaptive and roofline is None:
            roofline = self.roofline(window, cpu_threads)
        parsed = parse_policy(policy, roofline)
        if self.cache.active_slots:
            raise ValueError(f"cannot switch the KV policy while {plural(len(self.cache.active_slots), 'request')} hold KV")
        if parsed is None:
            cache: KVCache = ContiguousKVCache(self.config.kv_layout, self.config.num_layers, self.dtype, self.device)
        else:
            if self.config.attention.sliding_window is not None:
                raise ValueError(
                    f"policy {policy!r} needs full attention but the model has sliding_window="
                    f"{self.config.attention.sliding_window}: use policy 'resident'"
                )
            spec = PartitionSpec(self.config.kv_layout, self.config.num_layers, self.dtype, window=window)
            cache = InplaceKVCache(spec, parsed, self.device, cpu_threads)
            cache.warm_up(self.config.attention.q_heads)
        if isinstance(self.cache, InplaceKVCache):
            self.cache.close()
        self.cache, self.policy, self.window, self.cpu_threads = cache, parsed, window, cpu_threads
        self.attention_threads = cpu_threads or default_attention_threads(self.device)  # what the CPU attention uses
        if getattr(self, "expert_worker", None) is not None:  # the CPU team's settings as this policy's worker has them
            from writescope.attention.cpu_worker import worker_cpus

            self.expert_worker.refresh(worker_cpus(self.attention_threads))
        self.policy_name = "resident" if parsed is None else parsed.name
        if isinstance(cache, InplaceKVCache):  # O, measured across caches (scheduler/other_work.py)
            cache.other_work = self.other_work
        if isinstance(parsed, WriteScopePolicy):  # O, and A from earlier decode steps where they were kept
            parsed.attach(self.other_work, self.attention_threads, cache.micro_batches, cache.prefetch_tokens)
        self._attach_expert_work()

    def _graph_captures(self) -> int:
        """CUDA graphs the decode step has captured so far (0 without graphs)."""
        graphs = getattr(getattr(self.model, "decode", None), "graphs", None)
        return graphs.captured if graphs is not None else 0

    def _attach_expert_work(self) -> None:
        """The joint roofline's per-step expert split for the policy and expert share set now
        (scheduler/expert_work.py), and the in-place expert reads' link time the KV roofline counts."""
        kv_token = self.config.kv_layout.bytes_per_token(self.dtype.itemsize)
        self.expert_work = attach_expert_work(self.policy, getattr(self.cache, "decoder", None), self._moe_blocks, kv_token,
                                              self.expert_stream_share_given is not None, self.max_batch)
        if isinstance(self.policy, WriteScopePolicy):
            spb, below = self.policy.roofline.b / kv_token, getattr(self.expert_work, "in_place_below", 0)
            if self.expert_work is None:
                self.other_work.link_seconds = in_place_link_seconds(self._moe_blocks, spb, self.config.num_layers, self.max_batch)
            elif below > 1:  # passes below the split's threshold read host experts in place: their link time counts there,
                # at G as attach measured it (the slower of the KV copies and the fused kernels' in-place read)
                link = in_place_link_seconds(self._moe_blocks, self.expert_work.g, self.config.num_layers, below - 1)
                self.other_work.link_seconds = None if link is None else (lambda batch: link(batch) if batch < below else 0.0)
            else:
                self.other_work.link_seconds = None
        self._refresh_cpu_experts_from()

    def _refresh_cpu_experts_from(self) -> None:
        """After anything that changed the expert path, tell the cache from how many tokens a decode
        step has the host compute experts mid-layer (:meth:`_cpu_experts_from`): there
        ``WRITESCOPE_LOAD_COPIES=auto`` copies the next layer's first fills early (the split
        decoder's ``early_from``), and below it ``WRITESCOPE_MICRO_BATCHES=auto`` splits the step
        (the cache's and the policy's ``cpu_experts_from``: the balance leaves O out there)."""
        decoder = getattr(self.cache, "decoder", None)
        if decoder is not None:
            decoder.early_from = self.cache.cpu_experts_from = self._cpu_experts_from()
            if isinstance(self.policy, WriteScopePolicy):
                self.policy.cpu_experts_from = decoder.early_from

    def _cpu_experts_from(self) -> int | None:
        """The fewest tokens a decode step at which the CPU computes some of its host experts in
        the middle of a layer (the host reads the routing back and waits), or None when no step
        does: from the per-step expert split's threshold where it is attached, from one token
        where a fixed stream share below 1 leaves few-token host experts to the CPU, else never
        (no host experts, or all read in place or streamed). A hosted block that cannot stream
        (no streaming slots, no grouped GEMM) has the CPU compute its decode experts from one token
        whatever the split of the others."""
        hosted = [b for b in self._moe_blocks if b.host_experts]
        if not hosted:
            return None
        if any(not b.streams_host_experts() and not b.reads_host_experts_in_place(self.max_batch) for b in hosted):
            return 1
        if self.expert_work is not None:
            return max(1, self.expert_work.in_place_below)
        if all(b.reads_host_experts_in_place(self.max_batch) for b in hosted):
            return None
        share = self.expert_stream_share
        return 1 if share is not None and share < 1 else None

    def set_expert_stream_share(self, share: float | None, attach: bool = True) -> None:
        """Fix the share of the few-token host experts a decode step streams (``share`` in [0, 1],
        as ``expert_stream_share`` at construction; the rest the CPU computes), or give the choice
        back (None: the device's default, and under ``writescope`` the joint roofline's per-step
        split). Takes effect from the next forward, under the current policy; ``attach=False``
        detaches the per-step split and leaves attaching one to the next :meth:`set_policy` (which
        makes it anyway).

        Raises:
            ValueError: a share outside [0, 1] (or NaN, or not a number), or requests still holding
                KV (nothing changes); an error while attaching the split (everything as before).
        """
        check_share(share)
        if self.cache.active_slots:
            raise ValueError(f"cannot change the expert stream share while {plural(len(self.cache.active_slots), 'request')} run")
        hosted = [b for b in self._moe_blocks if b.host_experts]
        if share is not None and not hosted:
            warnings.warn(f"expert_stream_share={share} changes nothing here: no routed experts are in host memory "
                          "(every one fits the device under this budget, or no vram_budget was given)", stacklevel=2)
        elif share and not any(b.streams_host_experts() for b in hosted):  # 0 is what they do then: no warning
            why = next(w for w in map(SparseMoeBlock.why_not_streamed, hosted) if w is not None)
            warnings.warn(f"expert_stream_share={share} changes nothing here: the CPU computes decode's host experts ({why})",
                          stacklevel=2)
        policy_experts = self.policy.experts if isinstance(self.policy, WriteScopePolicy) else None
        before = (self.expert_stream_share_given, self.expert_work, policy_experts,
                  [(b.stream_share, b.expert_work) for b in self._moe_blocks], self.other_work.link_seconds)
        self.expert_stream_share_given = share
        for b in self._moe_blocks:
            b.stream_share = default_stream_share(self.device) if share is None else share
        if not attach:  # the old split chose under the old share: detached until set_policy attaches one
            detach_expert_work(self.policy, self._moe_blocks)
            self.expert_work = None
            self._refresh_cpu_experts_from()
            return
        try:
            self._attach_expert_work()
        except BaseException:
            self.expert_stream_share_given, self.expert_work, policy_experts, blocks, link = before
            for b, (old_share, old_work) in zip(self._moe_blocks, blocks):
                b.stream_share, b.expert_work = old_share, old_work
            if isinstance(self.policy, WriteScopePolicy):
                self.policy.experts = policy_experts
            self.other_work.link_seconds = link
            raise

    @property
    def expert_stream_share(self) -> float | None:
        """The share of the few-token host experts (fewer than ``stream_min_tokens``) that a decode
        step streams to the device, read from the MoE blocks as they are now: None when no block
        has routed experts in host memory; 0.0 when a block that has some cannot stream them (no
        streaming slots in the budget, or no grouped GEMM here); else the smallest block's
        ``stream_share`` (all equal unless changed by hand). Experts with more tokens are
        streamed whatever the share."""
        hosted = [b for b in self._moe_blocks if b.host_experts]
        if not hosted:
            return None
        if not all(b.streams_host_experts() for b in hosted):
            return 0.0
        return min(b.stream_share for b in hosted)

    def host_experts_in_decode(self) -> str:
        """Where a decode step computes the routed experts in host memory, in words
        (see :attr:`expert_stream_share`), and whether the CPU's share runs on the native expert
        worker (moe/async_experts.py) or on the thread that issues the step."""
        where = self._host_experts_where()
        hosted = [b for b in self._moe_blocks if b.host_experts]
        if not hosted or all(b.reads_host_experts_in_place(self.max_batch) for b in hosted) and getattr(self, "expert_work", None) is None:
            return where
        w = hosted[0].gate.weight
        cpu_share = getattr(self, "expert_work", None) is not None or (self.expert_stream_share or 0.0) < 1
        if cpu_share and all(b.takes_async(w.dtype, w.device, self.max_batch) for b in hosted):
            return where + "; the CPU's share on the native expert worker, split on the device (no host wait)"
        return where  # the CPU's share, if any, on the issuing thread after reading the routing back

    def _host_experts_where(self) -> str:
        share = self.expert_stream_share
        if share is None:
            return "no routed experts in host memory"
        work = getattr(self, "expert_work", None)
        if work is not None:
            why = f": {work.why}" if work.why else ""
            return f"host experts split between streaming and the CPU each decode step by the joint roofline (--policy writescope){why}"
        hosted = [b for b in self._moe_blocks if b.host_experts]
        if all(b.reads_host_experts_in_place(self.max_batch) for b in hosted):  # implies share 1 (block._host_in_place_configured)
            return "host experts read in place over PCIe by the fused decode kernels"
        if share == 0:
            why = ""
            if min(b.stream_share for b in hosted) > 0:  # asked for streaming, but a block cannot: say why
                why = next(f" ({w})" for w in map(SparseMoeBlock.why_not_streamed, hosted) if w is not None)
            return "few-token host experts computed on the CPU in decode" + why
        if share == 1:
            return "host experts streamed to the device in decode"
        return f"a share of {share:g} of the few-token host experts streamed to the device in decode, the rest computed on the CPU"

    def roofline(self, window: int = DEFAULT_WINDOW, cpu_threads: int | None = None) -> Roofline:
        """Calibrated A, B, C for this model's KV shape on this machine: stored, or measured now
        (once per machine and shape; see :mod:`writescope.scheduler.calibrate`)."""
        return self._roofline(self.config, window, cpu_threads)

    def stored_calibration(self, window: int = DEFAULT_WINDOW) -> dict | None:
        """The stored calibration entry behind :meth:`roofline` for this model's KV shape (its
        fitted values, measured points and limits: :func:`writescope.scheduler.calibrate.stored_entry`),
        or None where none is stored."""
        from writescope.scheduler.calibrate import shape_key, stored_entry

        cfg = self.config
        return stored_entry(self.device, shape_key(cfg.kv_layout, cfg.attention.q_heads, self.dtype, window))

    def _roofline(self, cfg, window: int, cpu_threads: int | None) -> Roofline:
        """Kept per (window, cpu_threads): under a budget the first lookup happens before the
        weights load, and a later one must not measure under the cap."""
        key = (window, cpu_threads)
        if key not in self._rooflines:
            if self.progress:
                print("writescope policy: looking up this machine's calibration (measured once if missing)", flush=True)
            self._rooflines[key] = load_or_calibrate(cfg.kv_layout, cfg.attention.q_heads, self.dtype, self.device, window,
                                                     cpu_threads, self.progress)
        return self._rooflines[key]

    # ---------------------------------------------------------------- validation
    def _prepare(self, prompts, prompt_token_ids, params) -> tuple[list[str | None], list[list[int]], list[SamplingParams]]:
        texts, ids, name = token_lists(prompts, prompt_token_ids, self.tokenizer.encode)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ArgError(f"{len(plist)} SamplingParams for {plural(len(ids), 'prompt')}: pass one, or one per prompt",
                           "sampling_params")
        check_token_ids(ids, self.config.vocab_size, name)
        for i, (p, sp) in enumerate(zip(ids, plist)):
            if len(p) == 0:
                raise ArgError(f"{name}[{i}] is empty (0 tokens): give every request at least one token", name)
            if len(p) + sp.max_tokens > self.max_model_len:
                raise too_long(name, i, len(p), sp.max_tokens, self.max_model_len, self.config.max_position_embeddings)
        self._check_memory([len(p) + sp.max_tokens for p, sp in zip(ids, plist) for _ in range(sp.n)])  # n slots each
        return texts, ids, plist

    def _check_memory(self, capacities: list[int]) -> None:
        """Refuse a batch whose KV cache cannot fit free memory, before allocating."""
        if isinstance(self.cache, InplaceKVCache):
            dev_free = available_memory(self.device) if self.device.type == "cuda" else None
            self.cache.check_capacity(capacities, dev_free, available_memory(torch.device("cpu")), self.pinned_budget)
            return
        need = sum(self.cache.bytes_for(c) for c in capacities)
        free = available_memory(self.device)
        if free is not None and need > 0.9 * free:
            raise ValueError(
                f"the batch's KV cache needs {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free on "
                f"{self.device}: use fewer or shorter requests"
            )

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        prompts: str | Sequence[str | Sequence[int] | dict] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        on_tokens: OnTokens | None = None,
    ) -> list[RequestOutput]:
        """Generate for a batch of requests (ragged lengths allowed), all prefilled together
        then decoded together, on the engine's scheduler (:class:`~writescope.engine.runner.EngineCore`
        with ``offline=True``). ``prompts``: strings, token-id lists, or vLLM's prompt dicts
        (``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``); or the ids as ``prompt_token_ids``.
        ``on_tokens`` is called with the new tokens as they are sampled:
        after the prefill and after every decode step (see :mod:`writescope.engine.streaming`).
        Returns one :class:`RequestOutput` per prompt, in order, with its ``SamplingParams.n``
        choices in ``outputs`` (its own fields are choice 0's). Each choice is a request of its
        own (:mod:`writescope.engine.choices`: choice i seeded ``seed + i`` with a seed); sampled
        choices without a seed use the engine's ``seed`` + their index among the batch's
        choices (with n = 1, the prompt's index). ``on_tokens`` events carry the prompt's index
        and the choice. With ``SamplingParams.stop`` a choice's text ends before the first stop
        string it produces (after it with ``include_stop_str_in_output``; its ``token_ids`` keep
        the token that completed it, ``stop_reason`` names it); with ``SamplingParams.logprobs``
        each choice carries its tokens' logprobs (``CompletionOutput.logprobs``) and their sum
        (``CompletionOutput.cumulative_logprob``).

        Raises:
            ValueError (``ArgError``, naming the argument): empty prompts, an id outside the
                vocabulary (named with its request, position and the vocab size), prompt + max_tokens beyond
                ``max_model_len``, or a KV cache larger than free memory. Nothing is allocated
                then, and the engine stays usable. Whatever the prefill or a decode step raises
                is raised after every slot of the batch is freed.
        """
        texts, ids, plist = self._prepare(prompts, prompt_token_ids, sampling_params)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        core = EngineCore(self, offline=True)
        flat = expand_batch(plist)  # (prompt, choice, params) of every choice
        reqs = [core.make_request(ids[i], sp, checked=True) for i, _, sp in flat]
        index = {r.request_id: k for k, r in enumerate(reqs)}
        for r in reqs:
            core.add(r)
        self.prefill_chunks = []  # this call's passes only (bench --kv-fill random replaces the prefill: none)
        try:
            core.admit_all()
            self.r_trace = core.r_trace
            synchronize(self.device)
            t0 = time.perf_counter()
            while core.has_work():
                outs = sorted(core.step(), key=lambda o: index[o.request_id])
                if on_tokens is not None:
                    where = [flat[index[o.request_id]][:2] for o in outs]  # (prompt, choice)
                    on_tokens([TokenEvent(i, t, o.finish_reason if j == len(o.new_token_ids) - 1 else None, c)
                               for o, (i, c) in zip(outs, where) for j, t in enumerate(o.new_token_ids)])
            t_end = time.perf_counter()
        finally:
            self.decode_host = list(core.decode_host)
            self.decode_between = list(core.decode_between)
            failed = [o.error for o in core.abort_all() if o.error]  # after an exception: free every slot
            if isinstance(self.policy, WriteScopePolicy):  # A and C_cpu as this batch's decode steps saw them, for the next policy's prefill
                self.other_work.keep_in_step_a(self.attention_threads, self.policy.in_step_a)
                self.other_work.keep_in_step_c(self.attention_threads, self.policy.batch, self.policy.in_step_c)
            try:
                self.other_work.save()  # O and A measured in this run, for the first batch of a later process
            except Exception as e:  # never the run's result or its own error: only the keeping is lost
                warnings.warn(f"writescope: the measured work outside attention was not kept: {type(e).__name__}: {e}", stacklevel=2)
        if failed:
            raise RuntimeError(failed[0])
        peak = peak_memory(self.device)
        t_first = max(r.first_token_at for r in reqs)  # all first tokens are sampled after the whole prefill
        t_last = max(r.last_token_at for r in reqs)
        # the decode phase ends with its last token; freeing the last requests' KV after it (unregistering
        # pinned slabs: about 0.13 s per GB on the H200 machine) is timed apart, as release_s
        prefill_s, decode_s = t_first - t0, max(t_last - t_first, 0.0)
        self.release_s = t_end - t_last
        decode_tokens = sum(len(r.output_ids) - 1 for r in reqs)
        prefilled = sum(len(r.prompt_ids) for r in reqs)  # every choice prefills its prompt
        choices = []
        for (i, c, _), r in zip(flat, reqs):
            n = len(r.output_ids)
            metrics = RequestMetrics(
                prompt_tokens=len(ids[i]),
                output_tokens=n,
                ttft_s=prefill_s,
                tpot_s=(r.last_token_at - t_first) / (n - 1) if n > 1 else 0.0,
                e2e_s=r.last_token_at - t0,
                prefill_tok_s=prefilled / prefill_s,
                decode_tok_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
                peak_memory_bytes=peak,
            )
            text = r.stops.text if r.stops is not None else self.tokenizer.decode(r.output_ids)  # stop strings: cut at the first
            cumulative = sum(lp.logprob for lp in r.logprobs) if r.logprobs is not None else None  # every token's, as sampled
            choices.append(CompletionOutput(c, text, r.output_ids, r.finish_reason, r.stop_reason, r.logprobs, cumulative,
                                            metrics, r.kv_placement))
        outputs = []
        for i, its in enumerate(group(flat, choices)):
            outputs.append(RequestOutput.of(self._next_request_id, texts[i], ids[i], its))
            self._next_request_id += 1
        return outputs

    def _prefill(self, ids: list[list[int]], slots: list[int]) -> torch.Tensor:
        """The offline batch's prefill (:func:`writescope.engine.runner.prefill_batch`): last-token
        logits ``[batch, vocab]``. A hook: ``writescope bench --kv-fill random`` replaces it on
        the instance (writescope/bench/runner.py)."""
        return prefill_batch(self, ids, slots)


def peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA allocator peak since the last reset, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
