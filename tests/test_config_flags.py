"""Config flags reach the forward pass: flipping one changes the logits exactly where it should,
and flags that must not matter leave them unchanged.

Each model is built from a preset config with HF-field overrides, filled with the same seeded
synthetic weights, and run as one prefill over the same prompt.
"""

from __future__ import annotations

import pytest
import torch

from writescope.attention import ForwardBatch
from writescope.checkpoint.synthetic import fill_synthetic
from writescope.kvcache import ContiguousKVCache
from writescope.models import build_model
from writescope.presets import preset_config

PROMPT_LEN = 40
CHANGED = 1e-2  # a flag that acts moves some logit by at least this (observed: 0.1 .. 3)
SAME = dict(rtol=1e-5, atol=1e-5)  # a flag that must not act leaves logits equal to this


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 4096, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))


def prefill_logits(preset: str, ids: torch.Tensor, **overrides) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of one prefill with seed-0 synthetic weights."""
    cfg = preset_config(preset).with_overrides(**overrides)
    model = build_model(cfg, torch.float32, "cpu")
    fill_synthetic(model, seed=0, progress=False)
    cache = ContiguousKVCache(cfg.kv_layout, cfg.num_layers, torch.float32, "cpu")
    slot = cache.allocate(len(ids))
    batch = ForwardBatch.build([slot], [len(ids)], [0], "cpu")
    return model(ids, batch, cache, all_logits=True)


def per_position_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[T]`` largest absolute logit difference at each position."""
    return (a - b).abs().amax(dim=-1)


def test_presets_have_the_defaults_the_flips_start_from():
    assert preset_config("tiny-qwen3-moe").moe.norm_topk_prob is True
    ds = preset_config("tiny-deepseek-v2").moe
    assert (ds.norm_topk_prob, ds.routed_scaling_factor, ds.top_k) == (False, 1.0, 3)
    assert preset_config("tiny-mixtral").attention.sliding_window is None
    assert preset_config("tiny-mixtral").with_overrides(sliding_window=8).attention.sliding_window == 8


@pytest.mark.parametrize(
    "preset, base, flipped",
    [
        ("tiny-qwen3-moe", dict(norm_topk_prob=True), dict(norm_topk_prob=False)),
        ("tiny-deepseek-v2", dict(norm_topk_prob=False), dict(norm_topk_prob=True)),
        # applies because norm_topk_prob is false (DeepSeek-V2 scales only un-normalised weights)
        ("tiny-deepseek-v2", dict(routed_scaling_factor=1.0), dict(routed_scaling_factor=2.5)),
        ("tiny-qwen3-moe", dict(), dict(use_sliding_window=True, sliding_window=8)),
    ],
    ids=["qwen3-norm_topk_prob", "deepseek-norm_topk_prob", "deepseek-routed_scaling_factor", "qwen3-use_sliding_window"],
)
def test_flag_changes_logits(prompt, preset, base, flipped):
    diff = per_position_diff(prefill_logits(preset, prompt, **base), prefill_logits(preset, prompt, **flipped))
    assert diff.max() > CHANGED, f"{flipped} did not change {preset}'s logits"


def test_mixtral_sliding_window_acts_only_past_the_window(prompt):
    full = prefill_logits("tiny-mixtral", prompt, sliding_window=None)
    windowed = prefill_logits("tiny-mixtral", prompt, sliding_window=8)
    # positions 0..7 see at most 8 keys, so the window cannot matter there
    torch.testing.assert_close(windowed[:8], full[:8], **SAME)
    # from position 8 on, the first key drops out of view: every later position changes
    diff = per_position_diff(windowed, full)[8:]
    assert (diff > CHANGED).all(), f"positions unchanged by the window: {(diff <= CHANGED).nonzero().flatten().add(8).tolist()}"


@pytest.mark.parametrize(
    "preset, base, flipped",
    [
        # a window covering the whole prompt (equal to, or longer than it) hides nothing
        ("tiny-mixtral", dict(sliding_window=None), dict(sliding_window=PROMPT_LEN)),
        ("tiny-mixtral", dict(sliding_window=None), dict(sliding_window=4096)),
        # Mixtral always renormalises its top-k weights (HF MixtralTopKRouter)
        ("tiny-mixtral", dict(), dict(norm_topk_prob=False)),
        # Qwen3-MoE ignores sliding_window unless use_sliding_window is set
        ("tiny-qwen3-moe", dict(), dict(sliding_window=8)),
        # renormalised weights are not scaled (DeepSeek-V2 MoEGate)
        ("tiny-deepseek-v2", dict(norm_topk_prob=True), dict(norm_topk_prob=True, routed_scaling_factor=2.5)),
    ],
    ids=["mixtral-window-eq-prompt", "mixtral-window-gt-prompt", "mixtral-norm_topk_prob",
         "qwen3-window-without-use", "deepseek-scaling-after-renorm"],
)
def test_flag_without_effect_keeps_logits(prompt, preset, base, flipped):
    a, b = prefill_logits(preset, prompt, **base), prefill_logits(preset, prompt, **flipped)
    torch.testing.assert_close(b, a, **SAME)



@pytest.mark.parametrize("var,bad,good,words", [
    ("WRITESCOPE_PREFILL_LOAD_STREAM", "sideways", "compute", "'evict' \\(the default\\) or 'compute'"),
    ("WRITESCOPE_GPU_ATTENTION", "cuda-c", "torch", "'triton' \\(the default\\) or 'torch'"),
])
def test_cache_switches_are_checked_when_the_cache_is_made(monkeypatch, var, bad, good, words):
    import torch

    from writescope.attention import gpu_kernel
    from writescope.config import KVLayout
    from writescope.kvcache.inplace import InplaceKVCache
    from writescope.kvcache.spec import PartitionSpec
    from writescope.scheduler.policies import parse_policy

    spec = PartitionSpec(KVLayout(2, 16, 16, False), 1, torch.bfloat16, window=8)
    monkeypatch.setenv(var, bad)
    with pytest.raises(ValueError, match=f"{var}='{bad}': use {words}"):
        InplaceKVCache(spec, parse_policy("gpu"), "cpu")
    monkeypatch.setenv(var, good)
    InplaceKVCache(spec, parse_policy("gpu"), "cpu").close()
    if var == "WRITESCOPE_GPU_ATTENTION":
        assert not gpu_kernel.available(torch.device("cuda"), torch.bfloat16)  # switched off even where CUDA and Triton exist
