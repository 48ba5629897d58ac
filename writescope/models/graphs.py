"""CUDA graphs of a decode step's tensor work between two cache attentions (issue 15).

A decode layer is cut at its cache: what comes before the cache (norm, projections, rope) and
after it (output projection, residual, MLP or experts) is tensor work of fixed shapes, while the
cache's part is host logic (regions, plans, streams, the CPU worker). A *stage* is the tensor
work between two attentions: ``post`` of layer l-1 then ``pre`` of layer l (models/decode_step.py).
Launched op by op from Python, a stage of DeepSeek-V2-Lite is about a hundred kernels, which the
main thread issues one at a time; replayed as one CUDA graph it is one launch.

A graph is captured per (stage, micro-batch, tokens, what the stage depends on beyond shapes: the
MLP's :meth:`graph_key`), on first use: its inputs are copied into static buffers, the stage runs
once eagerly as a warm-up (first-use allocations, packing, kernel selection), then it is captured
and replayed; later uses copy their inputs in and replay. Its outputs are static buffers that the
next replay of the same graph overwrites (and, in one pool, a later-captured graph's scratch may
too, see below), which is why each micro-batch has graphs of its own and outputs are read before
their micro-batch's next stage.
Each micro-batch's graphs have memory pools of their own (a batch that shrinks captures one
micro-batch's shapes at another step than the other's). Graphs that share a pool are safe to
replay in stage order whatever the order of their captures (a new key, say after a repack,
captures one stage after later ones; a later capture may put its outputs where an earlier graph
keeps its scratch) because every stage's outputs are used up on the compute stream, copied into
the next stage's static inputs or read by the attention (which other streams wait for before it
returns), before its micro-batch's next graph replays: nothing reads a stage's outputs later.

A stage has two forms, whole (``l``) and cut around its MLP (``(l, "before")``, ``(l, "after")``,
models/decode_step.py), and both are kept: the expert path decides the form (the in-place read
whole, the native expert worker cut), and a policy or expert share set on a loaded model may switch
it back and forth. Recapturing the other form cost the first decode step after each switch
0.2-0.5 s, which run 59's grids (8 steps a row, policies taking turns) counted as 30-67 ms a step
against every `writescope` row (benchmarks/results/gpu_decode_h200.md). For the same reason a stage
keeps one key per expert path (:func:`expert_path`): with ``WRITESCOPE_GRAPH_EXPERTS=on`` the worker's
path captures whole too, under a key other than the in-place read's. The cut parts are captured
into a pool of their own (two pools a micro-batch), so the two forms never share memory. Memory
kept: each form's static outputs per shape (the last stage's float32 logits, [tokens, vocab],
included) and both pools.

Captures use torch's ``thread_local`` error mode: the prefill writer's and the CPU worker's threads
may touch CUDA meanwhile. A stage whose capture fails runs eagerly from then on, exactly as before
(one warning names the first such stage and where it failed; on the H200, torch's ``_grouped_mm``
copied from pageable host memory inside fp32 captures).

``WRITESCOPE_CUDA_GRAPHS``: ``on`` (the default, on CUDA devices) or ``off``.
"""

from __future__ import annotations

import traceback
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch

from writescope.engine.ranges import named
from writescope.engine.replay_hooks import collecting
from writescope.moe.async_experts import GRAPH_KEY_MARK
from writescope.native.flag_worker import WorkerError
from writescope.env import env_choice

MAX_SHAPES = 32  # distinct (micro-batch, tokens) shapes kept (a server's batch sizes); the oldest shape's graphs go first


def expert_path(key) -> str:
    """``"worker"`` for a stage key whose MoE block hands its CPU share to the native expert worker
    (moe/block.py ``_async_graph_key``: a tuple opening with ``GRAPH_KEY_MARK``), else
    ``"device"`` (the in-place read, device experts only, or no MoE). A stage keeps one graph per path and shape: the
    expert path may switch between the two on a loaded model, while a new key on the same path (a
    repack, a new worker: new addresses) replaces the old one, whose tensors may be gone."""
    return "worker" if isinstance(key, tuple) and key[:1] == (GRAPH_KEY_MARK,) else "device"


def graphs_wanted(device: torch.device) -> bool:
    """CUDA device and ``WRITESCOPE_CUDA_GRAPHS`` not ``off``.

    Raises:
        ValueError: another value than on/off (names it).
    """
    return env_choice("WRITESCOPE_CUDA_GRAPHS", ("on", "off")) == "on" and device.type == "cuda"


_WARMUP: dict[int, "torch.cuda.Stream"] = {}  # device index -> the one stream every capture's warm-up runs on


def warmup_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream of ``device`` on which every capture warms up. One for the process: cuBLAS
    keeps a workspace (32 MiB on Hopper) for every stream that runs a GEMM, from the caching
    allocator and never freed, so a new stream per capture could grow device memory by up to 32
    of them past the budget's plan (the likely cause of run 35's out-of-memory decode step on the
    H200, read from the code, not yet confirmed there; budget/plan.py ``GEMM_WORKSPACES``)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    stream = _WARMUP.get(index)
    if stream is None:
        stream = _WARMUP[index] = torch.cuda.Stream(index)
    return stream


class CudaCapture:
    """One stage captured as a CUDA graph (see module doc); ``hooks``: the host calls each replay
    makes before the graph's (engine/replay_hooks.py)."""

    def __init__(self, fn: Callable, inputs: tuple, pool):
        self.static = tuple(t.clone() for t in inputs)
        cur = torch.cuda.current_stream()
        side = self.warmup = warmup_stream(cur.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):  # the warm-up, on a side stream as torch's graph docs advise
            fn(*self.static)
        cur.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with collecting() as self.hooks, torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.out = fn(*self.static)
        self.pool = self.graph.pool()

    def replay(self, inputs: tuple):
        for s, t in zip(self.static, inputs):
            if s.data_ptr() != t.data_ptr():
                s.copy_(t)
        for hook in self.hooks:
            hook()
        try:
            self.graph.replay()
        except BaseException:  # the hooks' jobs would wait for inputs that never come: let them go
            for hook in self.hooks:
                cancel = getattr(hook, "cancel", None)
                if cancel is not None:
                    cancel()
            raise
        return self.out


class EagerCapture:
    """The semantics of :class:`CudaCapture` without CUDA (tests): static inputs copied in, the
    stage run, its outputs copied into static buffers that the next replay overwrites."""

    def __init__(self, fn: Callable, inputs: tuple, pool):
        self.fn, self.static, self.pool = fn, tuple(t.clone() for t in inputs), pool
        self.out = _clone(fn(*self.static))

    def replay(self, inputs: tuple):
        for s, t in zip(self.static, inputs):
            if s.data_ptr() != t.data_ptr():
                s.copy_(t)
        _copy(self.out, self.fn(*self.static))
        return self.out


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    return None if x is None else tuple(_clone(t) for t in x)


def _copy(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif dst is not None:
        for d, s in zip(dst, src):
            _copy(d, s)


class StageGraphs:
    """The decode stages' graphs of one model (see module doc).

    Args:
        capture: :class:`CudaCapture` (the default) or :class:`EagerCapture` (tests).

    Attributes:
        captured, replayed: graphs captured, and replays, so far (tests, diagnostics).
        enabled: False: every stage runs eagerly.
        failed: the (stage, tokens, key) whose capture failed; they run eagerly (other token counts
            still try).
    """

    def __init__(self, capture=CudaCapture):
        self.capture, self.enabled, self.captured, self.replayed = capture, True, 0, 0
        self.failed: set[tuple] = set()  # (stage, tokens, key) whose capture failed: eager from then on
        self._shapes: OrderedDict[tuple, dict] = OrderedDict()  # (group, tokens) -> {(stage, key): captured}
        self._pools: dict[tuple[int, bool], object] = {}  # (micro-batch, cut part?) -> its graphs' memory pool

    def run(self, stage: int, group: int, tokens: int, key, fn: Callable, inputs: tuple):
        """``fn(*inputs)``, through the graph of ``(stage, group, tokens, key)``; ``key`` None:
        eagerly (the stage cannot be captured)."""
        if key is None or not self.enabled:
            return fn(*inputs)
        shape, pool = (group, tokens), (group, isinstance(stage, tuple))
        graphs = self._shapes.pop(shape, None)
        if graphs is None:
            graphs = {}
            while len(self._shapes) >= MAX_SHAPES:
                self._shapes.popitem(last=False)
        self._shapes[shape] = graphs  # the newest
        g = graphs.get((stage, key))
        if g is None:
            if (stage, tokens, key) in self.failed:
                return fn(*inputs)
            try:
                g = self.capture(fn, inputs, self._pools.get(pool))
            except WorkerError:  # a worker's job failed (checked inside the stage): the caller's error, not the capture's
                raise
            except Exception as e:  # noqa: BLE001 - any capture failure: this stage runs eagerly from now on
                self.failed.add((stage, tokens, key))
                if len(self.failed) == 1:  # once: the same cause usually fails several stages
                    where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)
                             if "writescope" in f.filename][-3:]
                    warnings.warn(f"CUDA graph capture of decode stage {stage} failed ({str(e)[:200]}; at {' < '.join(reversed(where))}); "
                                  "such stages run without graphs", stacklevel=3)
                return fn(*inputs)
            self._pools[pool] = g.pool
            # this stage's older key of the same expert path goes (a repack, a new worker); the other path's stays
            graphs = {k: v for k, v in graphs.items() if k[0] != stage or expert_path(k[1]) != expert_path(key)}
            graphs[(stage, key)] = g
            self._shapes[shape] = graphs
            self.captured += 1
        self.replayed += 1
        with named("decode.stage_graph"):  # the ranges inside a graph run only at its capture (bench/breakdown.py)
            return g.replay(inputs)
