"""The memory plan of a run under a GPU budget (docs/DESIGN.md section 6).

GPU: the non-expert weights (embeddings, lm_head, attention, norms, routers, shared experts,
dense MLPs) and the KV working set (D-windows and ping-pong buffers; all KV under ``resident``),
activations, then as many routed experts as the rest of the budget holds, spread evenly over
the MoE layers. Host: the other routed experts and the spilled KV (every whole block of every
sequence at full length; the policy decides how much of it is pinned, counted at its worst case
as the cache's own capacity check does) and the pinned staging buffers.

Activations are an estimate (stated so it can be checked): one prefill chunk of
T = min(prefill_chunk_tokens, batch x context) tokens holds about
T x (8 H + 2 (q_heads + 2 kv_heads) head_dim + top_k (3 I + 2 H)) elements of hidden states,
q/k/v, expert intermediates and the grouped GEMMs' gathered inputs and outputs, plus the
attention mask of 4096 x (context + max_new) bytes and the batch's float32 logits. For keys
wider than SDPA's fused kernels take (MLA), also the bound on the math path's scores, softmax and
mask (``writescope.attention.reference.SCORE_BYTES``) and float32 copies of one sequence's keys
(two) and values with ``WRITESCOPE_MLA_PREFILL=absorbed``; with ``expanded`` (the default) instead one
sequence's per-head keys and values and the same bound. A fixed ``RESERVE`` covers the allocator's fragmentation.

Beside them, ``GEMM_WORKSPACES``: PyTorch gives cuBLAS a workspace for every (thread's handle,
stream) pair that runs a GEMM, allocated from the caching allocator and kept (32 MiB each on
Hopper, by PyTorch's source): the stream of the thread that loads and calibrates, that of the
thread that issues decode steps (a server's engine thread is another), the CUDA graphs' warm-up
stream and their capture stream (models/graphs.py keeps one of each). Counted from the code, not
measured. Run 35 on the H200 ran out of device memory in a server's decode step, about 0.7-1 GiB
past the plan; the likely cause, read from the code and not yet confirmed on the device: each
graph's warm-up took a new stream, one workspace per stream up to torch's 32 pooled streams
(benchmarks/results/gpu_decode_h200.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from writescope.attention.reference import FUSED_MAX_DIM, SCORE_BYTES
from writescope.budget.weights import weight_sizes
from writescope.config import ModelConfig
from writescope.engine.prefill_order import GROUP_TOKENS, prefill_order_from_env
from writescope.units import parse_size  # noqa: F401 - imported from here too
from writescope.kvcache.inplace import READ_AHEAD_BYTES, read_ahead_from_env
from writescope.kvcache.sequence import pinned_staging_bytes
from writescope.layers.attention import mla_prefill_mode
from writescope.kvcache.spec import DEFAULT_WINDOW, PartitionSpec
from writescope.moe.streaming import stream_plan_bytes
from writescope.scheduler.policies import PlacementPolicy

GiB = 2**30
RESERVE = 512 * 2**20  # bytes kept free on the GPU for allocator fragmentation
CUBLAS_WORKSPACE = 32 * 2**20  # one cuBLAS workspace (PyTorch's default on Hopper; smaller on older GPUs)
GEMM_STREAMS = 4  # (thread, stream) pairs that run GEMMs: loading, issuing, the graphs' warm-up and capture (module doc)
GEMM_WORKSPACES = GEMM_STREAMS * CUBLAS_WORKSPACE


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per item; ``experts_gpu_per_layer[i]`` routed experts of MoE layer i on the GPU."""

    budget: int
    non_expert_weights: int
    expert_bytes: int
    experts_gpu_per_layer: tuple[int, ...]
    experts_total: int
    kv_gpu: int  # D-windows (or all KV under resident)
    pingpong: int
    activations: int
    reserve: int
    kv_host: int  # spilled KV in host memory (compute + load regions together, all of it spilled)
    kv_pinned_max: int  # the part of it the policy may put in the pinned load region
    pinned_staging: int
    host_free: int | None
    stream_slots: int = 0  # device weight slots for streaming host experts in long prefills (0: not streamed)
    workspaces: int = GEMM_WORKSPACES  # cuBLAS workspaces of the streams that run GEMMs (module doc)
    prefill_tokens: int = 0  # T, the tokens of the largest prefill pass the activations are sized for (0: not known)
    activations_small_chunk: int = 0  # the activations at MIN_ADVISED_CHUNK-token prefill passes (0: not known)

    @property
    def experts_gpu(self) -> int:
        return sum(self.experts_gpu_per_layer)

    @property
    def gpu_min(self) -> int:
        """Everything but routed experts: the least budget that can run."""
        return self.non_expert_weights + self.kv_gpu + self.pingpong + self.activations + self.workspaces + self.reserve

    @property
    def gpu_total(self) -> int:
        return self.gpu_min + self.experts_gpu * self.expert_bytes + self.stream_slots

    @property
    def weights_gpu(self) -> int:
        """Bytes of weights on the GPU: non-expert weights and the routed experts placed there."""
        return self.non_expert_weights + self.experts_gpu * self.expert_bytes

    @property
    def working_gpu(self) -> int:
        """Bytes the plan keeps on the GPU beside the weights and the reserve: KV, ping-pong,
        activations, GEMM workspaces and expert streaming slots."""
        return self.kv_gpu + self.pingpong + self.activations + self.workspaces + self.stream_slots

    def placement_line(self) -> str:
        """One line for the CLI: the budget and where the routed experts go."""
        return (f"VRAM budget {self.budget / 2**30:.2f} GiB: {self.experts_gpu} of {self.experts_total} routed experts on the device, "
                f"{self.experts_total - self.experts_gpu} in host memory")

    @property
    def expert_weights_host(self) -> int:
        return (self.experts_total - self.experts_gpu) * self.expert_bytes

    @property
    def host_total(self) -> int:
        return self.expert_weights_host + self.kv_host + self.pinned_staging

    def problem(self, flags: PlanFlags | None = None) -> str | None:
        """Why the plan cannot run, naming the minimum and what to change in the words of
        ``flags`` (default: the Python API's argument names); None when it can run. Where both
        the GPU budget and host memory fall short, both are said."""
        f = flags or API_FLAGS
        why = []
        if self.budget < self.gpu_min:
            chunk = ""
            smaller = self.gpu_min - self.activations + self.activations_small_chunk
            if f.chunk and self.prefill_tokens > MIN_ADVISED_CHUNK and 0 < self.activations_small_chunk and smaller <= self.budget:
                chunk = (f", or {f.chunk}{' ' if f.chunk.startswith('--') else '='}{MIN_ADVISED_CHUNK} (the activations are sized for prefill passes of {self.prefill_tokens:,} "
                         f"tokens; at {MIN_ADVISED_CHUNK:,} they take {self.activations_small_chunk / GiB:.2f} GiB and the minimum "
                         f"is {smaller / GiB:.3f} GiB)")
            why.append(
                f"a GPU budget of {self.budget / GiB:.3f} GiB is below the minimum of {self.gpu_min / GiB:.3f} GiB "
                f"(non-expert weights {self.non_expert_weights / GiB:.2f} + KV on the GPU {self.kv_gpu / GiB:.2f} + ping-pong "
                f"{self.pingpong / GiB:.2f} + activations {self.activations / GiB:.2f} + GEMM workspaces {self.workspaces / GiB:.2f} "
                f"+ reserve {self.reserve / GiB:.2f}): "
                f"raise {f.budget}, lower {f.sizes}" + chunk
                + (f", or use a partitioned {f.policy} (KV in host memory)" if self.kv_host == 0 else "")
            )
        if self.host_free is not None and self.host_total > 0.9 * self.host_free:
            short = self.host_total - 0.9 * self.host_free  # a larger budget frees at most the host experts' bytes
            why.append(
                f"the plan needs {self.host_total / GiB:.2f} GiB of host memory (experts {self.expert_weights_host / GiB:.2f} + "
                f"KV {self.kv_host / GiB:.2f} + staging {self.pinned_staging / GiB:.2f}) but "
                f"{self.host_free / GiB:.2f} GiB is free, of which at most 90% ({0.9 * self.host_free / GiB:.2f} GiB) is planned "
                "(the rest stays for the process and the OS): "
                + (f"raise {f.budget} (fewer experts on the host), " if self.expert_weights_host >= short else "")
                + f"lower {f.sizes}"
            )
        return "; and ".join(why) if why else None

    def check(self, flags: PlanFlags | None = None) -> None:
        """Raise :class:`PlanDoesNotFit` (a ValueError), naming the minimum and what to change
        in the words of ``flags`` (default: the Python API's argument names), if the plan cannot run."""
        why = self.problem(flags)
        if why is not None:
            raise PlanDoesNotFit(why, self)


@dataclass(frozen=True)
class PlanFlags:
    """The names :meth:`MemoryPlan.problem` gives what to change: the interface's own (the
    Python API's arguments, or the flags of the command being run)."""

    budget: str  # the GPU budget
    sizes: str  # what sets the batch and the tokens per sequence, with "or"
    policy: str  # the KV placement policy
    chunk: str = ""  # what sets the prefill pass's tokens ("": the interface has no such setting)


# Below this many tokens a prefill pass is not advised smaller (its GEMMs get inefficient).
MIN_ADVISED_CHUNK = 1024

API_FLAGS = PlanFlags("vram_budget", "max_batch or max_model_len (it defaults to the model's limit)", "policy", "prefill_chunk_tokens")


class PlanDoesNotFit(ValueError):
    """A plan that cannot run; ``plan.problem(flags)`` words the same refusal in another
    interface's names (the command line's flags)."""

    def __init__(self, message: str, plan: MemoryPlan):
        super().__init__(message)
        self.plan = plan


def layer_order_bytes(cfg: ModelConfig, spec: PartitionSpec, item: int, pass_tokens: int, batch: int, context: int,
                      order: str = "layer") -> int:
    """Device bytes of an offline prefill's passes run layer by layer (engine/prefill_order.py):
    the group's hidden states between layers and their rotary tables (float32), and the KV of one
    layer kept for its sequences' next passes: each sequence's KV of that layer so far, so up to
    the group's tokens plus, for a prompt longer than a group, what it brought from earlier groups
    (packed passes cut prompts wherever a pass fills, so any prefill of more than one pass may
    group); 0 where the whole prefill is one pass or the passes run one at a time (``order``
    ``chunk``)."""
    group = min(GROUP_TOKENS, batch * context)
    if order != "layer" or batch * context <= pass_tokens:  # one pass: nothing to group
        return 0
    # kept: each sequence's KV of the layer so far, so a group's sequences hold at most the group's tokens
    # plus what one of them brought from earlier groups (a prompt longer than a group: up to its context)
    kept = min(batch * context, max(group, context))
    return group * (cfg.hidden_size * item + cfg.rope.dim * 4) + kept * spec.token_bytes


def make_plan(
    cfg: ModelConfig,
    dtype: torch.dtype,
    budget: int,
    batch: int,
    context: int,
    max_new_tokens: int = 256,
    policy: PlacementPolicy | None = None,
    window: int = DEFAULT_WINDOW,
    prefill_chunk_tokens: int = 8192,
    host_free: int | None = None,
    gemm_workspaces: int = GEMM_WORKSPACES,
    prefill_order: str | None = None,
) -> MemoryPlan:
    """The plan for ``batch`` sequences of ``context + max_new_tokens`` tokens under ``budget`` bytes
    (``gemm_workspaces``: the cuBLAS workspaces' bytes; counted whatever the device, as the reserve
    is, so that a plan made on the CPU is the one CUDA gets; ``prefill_order``: ``layer`` or
    ``chunk``, the offline prefill's order, None: ``WRITESCOPE_PREFILL_ORDER``'s; a server's
    passes always run one at a time: ``chunk``).

    ``policy`` None means ``resident`` (all KV on the GPU). The plan is not checked here: call
    :meth:`MemoryPlan.check`.

    Raises:
        ValueError: batch, context or budget below 1.
    """
    if batch < 1 or context < 1 or budget < 1 or max_new_tokens < 0:
        raise ValueError(f"batch, context and budget must be >= 1 (got {batch}, {context}, {budget})")
    item = dtype.itemsize
    w = weight_sizes(cfg)
    a, m, H = cfg.attention, cfg.moe, cfg.hidden_size
    cap = context + max_new_tokens
    spec = PartitionSpec(cfg.kv_layout, cfg.num_layers, dtype, window=window)
    if policy is None:
        kv_gpu, pingpong, host, pinned, staging = batch * cap * cfg.num_layers * spec.token_bytes, 0, 0, 0, 0
    else:
        kv_gpu, pingpong = spec.window_bytes(batch), spec.pingpong_total_bytes()
        host = spec.host_bytes([cap] * batch)
        pinned = int(host * policy.max_load_share)
        staging = pinned_staging_bytes(spec, policy, batch, host)
    T = min(prefill_chunk_tokens, batch * context)
    per_token = (8 * H + 2 * (a.q_heads + 2 * a.kv_heads) * a.head_dim + m.top_k * (3 * m.intermediate_size + 2 * H)) * item
    act = T * per_token + 4096 * cap + batch * cfg.vocab_size * 4
    if policy is not None and policy.max_cpu_share > 0:
        # chunked prefill's compute-row reads started ahead (kvcache/inplace.py READ_AHEAD_BYTES): at most
        # read_ahead layers of one sequence's compute rows, each at most the policy's largest share of cap tokens of one layer
        act += min(READ_AHEAD_BYTES, int(read_ahead_from_env() * policy.max_cpu_share * cap * spec.token_bytes))
    # resident: every KV on the device, nothing read back, so the passes run one at a time
    order = "chunk" if policy is None else prefill_order_from_env() if prefill_order is None else prefill_order
    layered = layer_order_bytes(cfg, spec, item, T, batch, context, order)
    act += layered
    small = min(T, MIN_ADVISED_CHUNK)  # the same at MIN_ADVISED_CHUNK-token passes (which may group where T did not)
    act_small = act - (T - small) * per_token - layered + layer_order_bytes(cfg, spec, item, small, batch, context, order)
    if cfg.kv_layout.k_dim > FUSED_MAX_DIM and mla_prefill_mode() == "expanded":
        # one sequence's latents expanded to per-head keys and values, and the bound on scores
        # should SDPA take its math path for them
        act += cap * a.q_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * item + SCORE_BYTES
    elif cfg.kv_layout.k_dim > FUSED_MAX_DIM:  # SDPA's math path: scores, softmax, mask; float32 copies of keys and values
        act += SCORE_BYTES + cap * (2 * cfg.kv_layout.k_dim + cfg.kv_layout.v_dim) * 4
    expert_bytes = w.expert * item
    plan = MemoryPlan(budget, w.non_expert * item, expert_bytes, (), w.num_experts * w.moe_layers, kv_gpu, pingpong, act, RESERVE,
                      host, pinned, staging, host_free, workspaces=gemm_workspaces, prefill_tokens=T,
                      activations_small_chunk=act_small)
    room = max(0, budget - plan.gpu_min)
    n = min(plan.experts_total, room // expert_bytes) if expert_bytes else 0
    slots = stream_plan_bytes(H, m.intermediate_size, item) if expert_bytes else 0
    stream = 0
    if n < plan.experts_total and room >= slots:  # some experts on the host: keep room to stream them in prefill
        stream, room = slots, room - slots
        n = min(plan.experts_total, room // expert_bytes)
    per, extra = divmod(n, max(1, w.moe_layers))
    layers = tuple(per + (1 if i < extra else 0) for i in range(w.moe_layers))
    return MemoryPlan(**{**plan.__dict__, "experts_gpu_per_layer": layers, "stream_slots": stream})


def format_plan(plan: MemoryPlan, cfg: ModelConfig) -> str:
    """The plan as a readable table (GiB)."""
    g = lambda x: f"{x / GiB:9.2f} GiB"  # noqa: E731
    per = plan.experts_gpu_per_layer
    rows = [
        ("GPU budget", g(plan.budget)),
        ("  non-expert weights", g(plan.non_expert_weights)),
        (f"  routed experts on GPU ({plan.experts_gpu} of {plan.experts_total})", g(plan.experts_gpu * plan.expert_bytes)),
        ("    per MoE layer", f"{min(per, default=0)}-{max(per, default=0)} of {cfg.moe.num_experts}"),
        ("  KV on GPU (D-windows; all KV if resident)", g(plan.kv_gpu)),
        ("  ping-pong buffers", g(plan.pingpong)),
        ("  activations (estimate)", g(plan.activations)),
        (f"  GEMM workspaces (cuBLAS: {plan.workspaces // CUBLAS_WORKSPACE} streams x {CUBLAS_WORKSPACE >> 20} MiB)",
         g(plan.workspaces)),
        ("  expert streaming slots (prefill)", g(plan.stream_slots)),
        ("  reserve", g(plan.reserve)),
        ("  GPU total", g(plan.gpu_total)),
        ("  GPU minimum (no routed experts)", g(plan.gpu_min)),
        ("host", ""),
        ("  routed experts on host", g(plan.expert_weights_host)),
        ("  spilled KV (compute + load regions)", g(plan.kv_host)),
        ("    of which may be pinned (load region)", g(plan.kv_pinned_max)),
        ("  pinned staging", g(plan.pinned_staging)),
        ("  host total", g(plan.host_total)),
        ("  host free", "unknown" if plan.host_free is None else g(plan.host_free)),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


