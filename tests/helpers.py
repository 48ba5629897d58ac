"""Shared test utilities: HF reference checkpoints and running our model step by step."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from writescope.attention import ForwardBatch
from writescope.checkpoint.loader import load_weights
from writescope.config import ModelConfig
from writescope.kvcache import ContiguousKVCache
from writescope.models import build_model
from writescope.presets import preset_hf_dict

TINY = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2"]


def hf_reference_checkpoint(preset: str, out: Path, seed: int = 0, **overrides) -> Path:
    """A randomly initialised transformers model of the preset, saved with its own
    ``save_pretrained``. Weights are re-drawn with unit-gain scales (HF's init, std 0.02, makes
    every layer nearly the identity and would hide errors)."""
    import transformers

    d = preset_hf_dict(preset)
    d.update(overrides)
    cfg = transformers.AutoConfig.for_model(**d)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.normal_(0, 0.02)
            elif "embed_tokens" in name:
                p.normal_()
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))
    model.save_pretrained(out)
    return out


def load_hf(path: Path, dtype: torch.dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def load_ours(path: Path, dtype: torch.dtype):
    cfg = ModelConfig.from_file(path)
    model = build_model(cfg, dtype, "cpu")
    load_weights(model, path, progress=False)
    return model


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """All-position logits ``[len(ids), vocab]`` float32 of one unpadded sequence."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def ours_prefill_then_decode(model, prompts: list[list[int]], continuations: list[list[int]]):
    """Prefill the ragged batch in one pass, then feed ``continuations`` one token per step
    (all sequences decoded together). Returns (prefill logits per sequence ``[len, vocab]``,
    decode logits per sequence ``[steps, vocab]``)."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    cache = ContiguousKVCache(cfg.kv_layout, cfg.num_layers, dtype, "cpu")
    steps = len(continuations[0])
    slots = [cache.allocate(len(p) + steps) for p in prompts]
    batch = ForwardBatch.build(slots, [len(p) for p in prompts], [0] * len(prompts), "cpu")
    flat = torch.tensor([t for p in prompts for t in p])
    logits = model(flat, batch, cache, all_logits=True)
    starts = batch.query_start_loc
    prefill = [logits[starts[i] : starts[i + 1]] for i in range(len(prompts))]
    decode = [[] for _ in prompts]
    for s in range(steps):
        ctx = [len(p) + s for p in prompts]
        b = ForwardBatch.build(slots, [1] * len(prompts), ctx, "cpu")
        out = model(torch.tensor([c[s] for c in continuations]), b, cache)
        for i in range(len(prompts)):
            decode[i].append(out[i])
    return prefill, [torch.stack(d) if d else torch.empty(0) for d in decode]


def interpreter_unusable() -> str | None:
    """Why Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) cannot run the kernels'
    checks here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (CPU torch): the torch path stands in"
    import numpy

    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        return f"Triton 3.6's interpreter fails on numpy {numpy.__version__} (scalar conversion); needs numpy < 2.4"
    return None


def run_under_interpreter(code: str, timeout: int) -> None:
    """Run ``code`` in a fresh Python with ``TRITON_INTERPRET=1`` (the interpreter is chosen when
    Triton is imported, so not in this process); fails the test with its output on an error."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))  # tests/, for the checks' own `from helpers import`
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join((os.getcwd(), here)))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def short_request_engine(device: str, policy: str):
    """``(llm, core)``: tiny-qwen3-moe, one layer, 64 tokens at most, windows of 4 tokens (so
    blocks are evicted under any partitioned policy), and an EngineCore over it."""
    from writescope import LLM
    from writescope.engine.runner import EngineCore

    llm = LLM("tiny-qwen3-moe", device=device, progress=False, max_model_len=64, num_layers=1)
    llm.set_policy(policy, window=4)
    return llm, EngineCore(llm)


def run_short_requests(core, n: int) -> None:
    """``n`` short requests one after another through an EngineCore (prompts of 4-12 tokens, 1-6
    new tokens, greedy), each to its end; any request's error fails the test."""
    from writescope import SamplingParams

    for i in range(n):
        core.add(core.make_request([3 + i % 50, 4, 5, 6 + i % 7] * (1 + i % 3), SamplingParams(max_tokens=1 + i % 6, ignore_eos=True)))
        while core.has_work():
            for o in core.step():
                assert o.error is None, o.error


def budget_plan(preset: str = "tiny-qwen3-moe", dtype: torch.dtype = torch.float32, batch: int = 2, budget: int = 2**40):
    """``make_plan`` of ``preset`` as the budget tests load it: ``window`` 16, ``static:0.5``,
    ``batch`` requests of ``dtype`` at the model's context limit, under ``budget`` bytes (by default
    one with room for everything)."""
    from writescope.budget.plan import make_plan
    from writescope.presets import preset_config
    from writescope.scheduler.policies import StaticPolicy

    cfg = preset_config(preset)
    return make_plan(cfg, dtype, budget, batch, cfg.max_position_embeddings, 0, StaticPolicy(0.5), 16)


def half_experts_budget(preset: str = "tiny-qwen3-moe", dtype: torch.dtype = torch.float32, batch: int = 2) -> int:
    """A VRAM budget (bytes) that leaves about half of ``preset``'s routed experts in host memory:
    the plan's device minimum (:func:`budget_plan`) and room for half the routed experts plus 8
    experts' worth of streaming slots. The tiny presets' plans depend on ``dtype`` and ``batch``;
    build the LLM with the same ``max_batch`` (and no smaller ``prefill_chunk_tokens``, which
    shrinks the working set and lets more experts fit)."""
    base = budget_plan(preset, dtype, batch)
    return base.gpu_min + (base.experts_total // 2 + 8) * base.expert_bytes


@torch.no_grad()
def teacher_forced_decode_logits(llm, prompts: list[list[int]], steps: int, device="cpu") -> torch.Tensor:
    """``[steps, B, vocab]`` float32 logits of ``steps`` decode passes of ``llm.model`` after one
    prefill of ``prompts``, each step fed a fixed token per sequence (teacher-forced: a near-tie
    cannot send two runs apart). The sequences are freed afterwards."""
    cache = llm.cache
    slots = [cache.allocate(len(p) + steps, prompt_len=len(p)) for p in prompts]
    try:
        batch = ForwardBatch.build(slots, [len(p) for p in prompts], [0] * len(prompts), device)
        llm.model(torch.tensor([t for p in prompts for t in p], device=device), batch, cache)
        out = []
        for s in range(steps):
            batch = ForwardBatch.build(slots, [1] * len(prompts), [len(p) + s for p in prompts], device)
            ids = torch.tensor([3 + (7 * s + 11 * i) % 1000 for i in range(len(prompts))], device=device)
            out.append(llm.model(ids, batch, cache).float().clone())
        return torch.stack(out)
    finally:
        for s in slots:
            cache.free(s)
