"""Routed experts in host memory, computed on the CPU in parallel single-threaded tasks
(docs/DESIGN.md section 6).

Why: decode gives each host expert 1-4 tokens, so its three GEMMs are matrix-vector products that
read the weights once. Run one expert after another, each GEMM on all threads, they read the
weights at 18-28 GB/s on the H200 host against its 86 GB/s (benchmarks/results/experts.md): every
small GEMM is a parallel region of its own. Here the work is cut into tasks that each run on one
thread of a pool, so the threads read different weights at the same time:

- phase 1, per expert and per chunk of the intermediate size I: ``act[:, c] = silu(x W_gate[c]ᵀ)
  · (x W_up[c]ᵀ)``;
- phase 2, per expert and per chunk of the hidden size D: ``y[:, c] = act W_down[c]ᵀ``.

A chunk of output columns is the same dot products as the whole GEMM, so the result is the same as
:meth:`writescope.layers.mlp.GatedMLP.forward` up to the kernels' accumulation order (tested
against it within one bf16 rounding step). With few active experts each is cut into more chunks,
so that there are at least ``threads`` tasks (chunks of at least ``MIN_ROWS`` rows).

Opt-in (``SparseMoeBlock.host_parallel``), not the default: whether it pays is not known yet. On
the 2-core CI machine it is within noise of the loop (Qwen3-30B-A3B block, every expert on the
host, bf16, pool against loop: 8.4 against 7.6 GB/s of weights at 4 tokens and 8.5 against 7.4
at 16 in one run, 8.1 against 10.1 and 7.2 against 7.0 in an earlier one that may have shared the
two cores with a test run; ``PYTHONPATH=. python benchmarks/experts.py
--models qwen3-30b-a3b --device cpu --dtype bf16 --tokens 4,16 --fractions 0 --repeats 5 --out
/tmp/experts_ci``). The H200 host, where the loop reaches only a quarter of the read bandwidth
with 16 threads, is measured by the same benchmark (both paths side by side).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

MIN_ROWS = 128  # output columns per task at least: smaller GEMVs cost more in call overhead than they read

_pools: dict[int, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """One pool per thread count for the process; each worker runs torch ops on one thread.

    ``torch.set_num_threads`` also sets the count that threads started later begin with, so all
    workers are started here at once (each waits at a barrier until all have set theirs), and the
    calling thread's count is set again afterwards, which restores that default."""
    with _lock:
        if threads not in _pools:
            before = torch.get_num_threads()
            pool = ThreadPoolExecutor(threads, "writescope-host-experts", initializer=torch.set_num_threads, initargs=(1,))
            barrier = threading.Barrier(threads)
            for f in [pool.submit(barrier.wait) for _ in range(threads)]:
                f.result()
            torch.set_num_threads(before)
            _pools[threads] = pool
        return _pools[threads]


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n // MIN_ROWS or 1))
    step = math.ceil(n / parts)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def run_host_experts(
    w13: list[torch.Tensor], w2: list[torch.Tensor], xs: list[torch.Tensor], threads: int
) -> list[torch.Tensor]:
    """SwiGLU experts on the CPU: ``down(silu(gate(x)) · up(x))`` per expert.

    Args:
        w13: per expert ``[2I, D]``: the gate rows then the up rows (a slice of
            :class:`writescope.moe.grouped.PackedExperts`'s ``w13``).
        w2: per expert ``[D, I]`` (the down projection).
        xs: per expert its tokens ``[n_e, D]``, n_e >= 1, in the weights' dtype.
        threads: tasks run at once (each on one thread); 1 runs them on the calling thread.

    Returns:
        Per expert ``[n_e, D]`` in the weights' dtype (no autograd graph).
    """
    if not xs:
        return []
    inter, hidden = w2[0].shape[1], w2[0].shape[0]
    per_expert = math.ceil(threads / len(xs))
    acts = [torch.empty(x.shape[0], inter, dtype=x.dtype) for x in xs]
    ys = [torch.empty(x.shape[0], hidden, dtype=x.dtype) for x in xs]

    # inference only: grad mode is per thread (workers start with it on), and tasks write shared
    # outputs in place from several threads, which autograd must not record
    @torch.no_grad()
    def up(e: int, a: int, b: int) -> None:
        g = F.linear(xs[e], w13[e][a:b])
        u = F.linear(xs[e], w13[e][inter + a : inter + b])
        acts[e][:, a:b] = F.silu(g) * u

    @torch.no_grad()
    def down(e: int, a: int, b: int) -> None:
        ys[e][:, a:b] = F.linear(acts[e], w2[e][a:b])

    for fn, width in ((up, inter), (down, hidden)):
        tasks = [(e, a, b) for e in range(len(xs)) for a, b in _chunks(width, per_expert)]
        if threads <= 1:
            for t in tasks:
                fn(*t)
        else:
            for f in [_pool(threads).submit(fn, *t) for t in tasks]:
                f.result()  # re-raises a task's error
    return ys
