"""Config fields read exactly as transformers reads them (issue 19, item 7).

For every supported model type, config dicts that leave fields out or set them unusually are
read twice: by :meth:`ModelConfig.from_hf` and by transformers' own config class (``from_dict``,
as ``from_pretrained`` does). Every field WriteScope reads is compared with what transformers'
config object, and the modules transformers builds from it, hold: sizes, heads, softmax scale,
sliding window, biases, MoE layout, the rope's inverse frequencies and cos/sin factor, and the
epsilon of every RMSNorm by module name (DeepSeek-V2's latent norms included). Models are built
on the meta device, so the full default sizes cost no memory. A last test compares a tiny
model's logits, saved by transformers' ``save_pretrained`` (which leaves default values out).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import hf_logits, hf_reference_checkpoint, load_hf, load_ours  # noqa: E402

from writescope.config import ModelConfig  # noqa: E402
from writescope.layers.norm import RMSNorm  # noqa: E402
from writescope.layers.rope import inv_frequencies  # noqa: E402
from writescope.models import LAYER_BUILDERS  # noqa: E402
from writescope.models.causal_lm import CausalLM  # noqa: E402
from writescope.presets import preset_hf_dict  # noqa: E402

SHARED = Path("/work/shared/models")
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707,
        "beta_fast": 32, "beta_slow": 1}


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def _tiny(preset: str, drop: tuple[str, ...] = (), **set_) -> dict:
    return {**_without(preset_hf_dict(preset), *drop), **set_}


def _yarn(drop: tuple[str, ...] = (), **set_) -> dict:
    return {**_without(YARN, *drop), **set_}


CASES = {
    # ------------------------------------------------------------ Qwen3-MoE
    "qwen3-bare": {"model_type": "qwen3_moe"},
    "qwen3-tiny": _tiny("tiny-qwen3-moe"),
    "qwen3-no-eps-theta-heads": _tiny("tiny-qwen3-moe", ("rms_norm_eps", "rope_theta", "head_dim", "num_key_value_heads",
                                                         "rope_scaling", "norm_topk_prob", "eos_token_id", "bos_token_id")),
    "qwen3-eps-1e-2": _tiny("tiny-qwen3-moe", rms_norm_eps=1e-2),
    "qwen3-sliding-default-width": _tiny("tiny-qwen3-moe", ("sliding_window",), use_sliding_window=True),
    "qwen3-sparse-step-mlp-only": _tiny("tiny-qwen3-moe", decoder_sparse_step=2, mlp_only_layers=[2]),
    "qwen3-rope-parameters": _tiny("tiny-qwen3-moe", ("rope_theta", "rope_scaling"),
                                   rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "qwen3-num-local-experts": _tiny("tiny-qwen3-moe", ("num_experts",), num_local_experts=6),
    # ------------------------------------------------------------ Mixtral
    "mixtral-bare": {"model_type": "mixtral"},
    "mixtral-tiny": _tiny("tiny-mixtral"),
    "mixtral-no-theta-eps-kv-heads": _tiny("tiny-mixtral", ("rope_theta", "rms_norm_eps", "num_key_value_heads",
                                                            "eos_token_id", "bos_token_id")),
    "mixtral-eps-3e-4-bias-head-dim": _tiny("tiny-mixtral", rms_norm_eps=3e-4, attention_bias=True, head_dim=16),
    "mixtral-sliding": _tiny("tiny-mixtral", sliding_window=64),
    # ------------------------------------------------------------ DeepSeek-V2
    "dsv2-bare": {"model_type": "deepseek_v2", "num_experts_per_tok": 6},
    "dsv2-tiny": _tiny("tiny-deepseek-v2"),
    "dsv2-no-q-lora-rank": _tiny("tiny-deepseek-v2", ("q_lora_rank",)),  # transformers: 1536, not None
    "dsv2-latent-norms-eps-1e-2": _tiny("tiny-deepseek-v2", q_lora_rank=16, rms_norm_eps=1e-2),
    "dsv2-no-moe-fields": _tiny("tiny-deepseek-v2", ("n_shared_experts", "first_k_dense_replace", "routed_scaling_factor",
                                                     "norm_topk_prob", "rms_norm_eps", "rope_theta", "attention_bias")),
    "dsv2-yarn-only-factor": _tiny("tiny-deepseek-v2", rope_scaling={"type": "yarn", "factor": 40}),
    "dsv2-yarn-no-mscale": _tiny("tiny-deepseek-v2", rope_scaling=_yarn(("mscale",))),
    "dsv2-yarn-no-mscale-all-dim": _tiny("tiny-deepseek-v2", rope_scaling=_yarn(("mscale_all_dim",))),
    "dsv2-yarn-no-betas": _tiny("tiny-deepseek-v2", rope_scaling=_yarn(("beta_fast", "beta_slow"))),
    "dsv2-yarn-beta-zero": _tiny("tiny-deepseek-v2", rope_scaling=_yarn(beta_fast=0, beta_slow=0)),
    "dsv2-yarn-no-truncate": _tiny("tiny-deepseek-v2", rope_scaling=_yarn(truncate=False)),
    "dsv2-yarn-attention-factor": _tiny("tiny-deepseek-v2", rope_scaling=_yarn(attention_factor=0.9)),
    "dsv2-yarn-null-factor": _tiny("tiny-deepseek-v2", max_position_embeddings=65536,
                                   rope_scaling=_yarn(("mscale_all_dim",), factor=None)),
    "dsv2-rope-parameters": _tiny("tiny-deepseek-v2", ("rope_scaling", "rope_theta"),
                                  rope_parameters={"rope_type": "yarn", "factor": 8, "rope_theta": 20000.0,
                                                   "original_max_position_embeddings": 2048, "mscale_all_dim": 1.0}),
    "dsv2-no-rope-scaling": _tiny("tiny-deepseek-v2", ("rope_scaling",)),
}
for p in sorted(SHARED.glob("*.json")) if SHARED.is_dir() else []:
    CASES[f"shared-{p.stem}"] = json.loads(p.read_text())


def hf_config(d: dict):
    """transformers' config object for ``d``, read as ``from_pretrained`` reads a config.json."""
    return transformers.CONFIG_MAPPING[d["model_type"]].from_dict(json.loads(json.dumps(d)))


def _hf_model(hc):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hc)


def _ours_model(cfg: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(cfg, LAYER_BUILDERS[cfg.model_type])


def _eos(e) -> tuple[int, ...]:
    return () if e is None else tuple(e) if isinstance(e, (list, tuple)) else (int(e),)


def hf_view(hc, model) -> dict:
    """The fields WriteScope reads, from transformers' config object and the model it builds."""
    attn = model.model.layers[0].self_attn
    view = {
        "vocab_size": hc.vocab_size, "hidden_size": hc.hidden_size, "num_layers": hc.num_hidden_layers,
        "max_position_embeddings": hc.max_position_embeddings, "rms_norm_eps": hc.rms_norm_eps,
        "tie_word_embeddings": hc.tie_word_embeddings, "bos_token_id": hc.bos_token_id, "eos_token_ids": _eos(hc.eos_token_id),
        "q_heads": hc.num_attention_heads, "softmax_scale": attn.scaling,
    }
    if hc.model_type == "deepseek_v2":
        view.update(q_lora_rank=attn.q_lora_rank, kv_lora_rank=attn.kv_lora_rank, qk_nope_head_dim=attn.qk_nope_head_dim,
                    qk_rope_head_dim=attn.qk_rope_head_dim, v_head_dim=attn.v_head_dim, head_dim=attn.qk_head_dim,
                    bias=attn.kv_a_proj_with_mqa.bias is not None, sliding_window=None)
    else:
        view.update(kv_heads=hc.num_key_value_heads, head_dim=attn.head_dim, bias=attn.q_proj.bias is not None,
                    sliding_window=getattr(attn, "sliding_window", None) if hc.model_type == "qwen3_moe" else hc.sliding_window)
    moe_layers = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    gate = next((model.model.layers[i].mlp.gate for i in moe_layers), None)
    view.update(
        moe_layers=moe_layers, top_k=hc.num_experts_per_tok, dense_intermediate_size=hc.intermediate_size,
        num_experts=gate.weight.shape[0] if gate is not None else None,
        intermediate_size=hc.moe_intermediate_size if hc.model_type != "mixtral" else hc.intermediate_size,
        norm_topk_prob=True if hc.model_type == "mixtral" else bool(hc.norm_topk_prob),
        routed_scaling_factor=getattr(hc, "routed_scaling_factor", 1.0),
        n_shared_experts=getattr(hc, "n_shared_experts", 0),
    )
    return view


def our_view(cfg: ModelConfig) -> dict:
    a, m = cfg.attention, cfg.moe
    view = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id, "eos_token_ids": cfg.eos_token_ids,
        "q_heads": a.q_heads, "softmax_scale": a.softmax_scale, "head_dim": a.head_dim, "bias": a.bias,
        "sliding_window": a.sliding_window,
    }
    if a.kind == "mla":
        view.update(q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                    qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim)
    else:
        view.update(kv_heads=a.kv_heads)
    view.update(moe_layers=m.moe_layers, top_k=m.top_k, dense_intermediate_size=m.dense_intermediate_size,
                num_experts=m.num_experts if m.moe_layers else None, intermediate_size=m.intermediate_size,
                norm_topk_prob=m.norm_topk_prob, routed_scaling_factor=m.routed_scaling_factor, n_shared_experts=m.n_shared_experts)
    return view


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-12)
    return a == b


def norm_eps(model) -> dict[str, float]:
    """``{module name: epsilon}`` of every RMSNorm (ours: ``eps``; transformers: ``variance_epsilon``)."""
    return {n: float(getattr(mod, "eps", getattr(mod, "variance_epsilon", None)))
            for n, mod in model.named_modules() if isinstance(mod, RMSNorm) or type(mod).__name__.endswith("RMSNorm")}


def hf_rope(hc, model) -> tuple[torch.Tensor, float]:
    """(inv_freq, cos/sin factor) of transformers' rotary embedding, built on the CPU."""
    rotary = type(model.model.rotary_emb)(hc)
    return rotary.inv_freq, rotary.attention_scaling


@pytest.mark.parametrize("case", list(CASES))
def test_fields_read_as_transformers_reads_them(case):
    d = CASES[case]
    hc = hf_config(d)
    ours = ModelConfig.from_hf(d)
    hf = _hf_model(hc)
    ours_v, hf_v = our_view(ours), hf_view(hc, hf)
    assert ours_v.keys() == hf_v.keys()
    differ = {k: (ours_v[k], hf_v[k]) for k in ours_v if not _same(ours_v[k], hf_v[k])}
    assert not differ, f"{case}: (ours, transformers) {differ}"
    assert norm_eps(_ours_model(ours)) == norm_eps(hf), case
    inv_hf, factor_hf = hf_rope(hc, hf)
    inv, factor = inv_frequencies(ours.rope)
    torch.testing.assert_close(inv, inv_hf.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(factor_hf, rel=1e-12), case


def test_the_latent_norms_keep_transformers_eps():
    """DeepSeek-V2's q_a_layernorm and kv_a_layernorm use 1e-6 whatever rms_norm_eps says."""
    cfg = ModelConfig.from_hf(CASES["dsv2-latent-norms-eps-1e-2"])
    eps = norm_eps(_ours_model(cfg))
    assert eps["model.layers.0.self_attn.kv_a_layernorm"] == 1e-6 == eps["model.layers.0.self_attn.q_a_layernorm"]
    assert eps["model.layers.0.input_layernorm"] == 1e-2


def test_a_field_transformers_has_no_default_for_is_named():
    d = _without(CASES["dsv2-tiny"], "num_experts_per_tok")
    assert hf_config(d).num_experts_per_tok is None
    with pytest.raises(ValueError, match="missing required field 'num_experts_per_tok'"):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize(
    "rope_scaling, match",
    [({"type": "yarn", "original_max_position_embeddings": 4096}, "has no 'factor'"),
     ({"type": "linear", "factor": 2.0}, "'linear' is not supported")],
)
def test_rope_scaling_refused_clearly(rope_scaling, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(_tiny("tiny-deepseek-v2", rope_scaling=rope_scaling))


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("tiny-qwen3-moe", dict(rms_norm_eps=1e-2)),
        ("tiny-mixtral", dict(rms_norm_eps=1e-2, attention_bias=True)),
        # latent norms at 1e-6 under an unusual rms_norm_eps; yarn without mscale, so the cos/sin
        # factor is mscale(factor) alone
        ("tiny-deepseek-v2", dict(q_lora_rank=16, rms_norm_eps=1e-2, rope_scaling=_yarn(("mscale", "beta_fast")))),
    ],
    ids=["qwen3", "mixtral", "deepseek-v2"],
)
def test_logits_match_transformers_with_unusual_fields(tmp_path, preset, overrides):
    path = hf_reference_checkpoint(preset, tmp_path, seed=3, **overrides)
    hf, ours = load_hf(path, torch.float32), load_ours(path, torch.float32)
    from writescope.attention import ForwardBatch
    from writescope.kvcache import ContiguousKVCache

    ids = torch.randint(3, ours.config.vocab_size, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = ContiguousKVCache(ours.config.kv_layout, ours.config.num_layers, torch.float32, "cpu")
    batch = ForwardBatch.build([cache.allocate(len(ids))], [len(ids)], [0], "cpu")
    with torch.no_grad():
        logits = ours(torch.tensor(ids), batch, cache, all_logits=True)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=0)
