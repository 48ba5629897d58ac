"""Frozen model configuration, normalised once from a Hugging Face ``config.json``.

Nothing outside this module reads raw HF config dicts: models, caches and loaders take a
:class:`ModelConfig`. Supported HF ``model_type`` values: ``qwen3_moe``, ``mixtral``,
``deepseek_v2``.

Field sources (HF ``transformers/models/<type>/configuration_<type>.py``):
- Qwen3-MoE: GQA with per-head q/k RMSNorm, routed experts on layers where
  ``(i + 1) % decoder_sparse_step == 0`` and ``i not in mlp_only_layers``.
- Mixtral: GQA, optional ``sliding_window``; every layer is MoE, top-k always renormalised.
- DeepSeek-V2: MLA (compressed latent of ``kv_lora_rank`` + shared rope key of
  ``qk_rope_head_dim``), YaRN rope, shared experts, ``first_k_dense_replace`` dense layers.

A field left out of the dict takes the default transformers 5.17 gives it (:data:`HF_DEFAULTS`, from
each ``configuration_<type>.py``; rope dictionaries as ``modeling_rope_utils`` completes them), so
a config.json saved by ``save_pretrained`` (which leaves default values out) reads as transformers
reads it. A field transformers has no usable default for raises ValueError naming it.
tests/test_config_defaults.py compares every field read here with transformers' config object.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v2")

# Defaults of the fields read here, as transformers 5.17 declares them (configuration_<type>.py;
# ``default_theta`` for rope_theta). ``_Fields`` uses them for a field the dict leaves out.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "rope_theta": 10000.0, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
        "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": [], "bos_token_id": None, "eos_token_id": None,
    },
    "mixtral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "rope_theta": 1000000.0, "sliding_window": None, "num_experts_per_tok": 2,
        "num_local_experts": 8, "bos_token_id": 1, "eos_token_id": 2,
    },
    "deepseek_v2": {
        "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "first_k_dense_replace": 0,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "n_routed_experts": 64, "n_shared_experts": 2, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_method": "greedy", "norm_topk_prob": False,
        "v_head_dim": 128, "moe_intermediate_size": 1407,  # num_experts_per_tok: None in transformers, so required here
    },
}
# DeepSeek-V2's latent norms (q_a_layernorm, kv_a_layernorm) are built as DeepseekV2RMSNorm(dim)
# in transformers' modeling_deepseek_v2.py, i.e. with that class's default eps, not rms_norm_eps.
MLA_LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters.

    ``interleaved``: DeepSeek-V2 checkpoints pair dimensions (2i, 2i+1) of the rope part;
    Llama-style checkpoints (Qwen3, Mixtral) pair (i, i + dim/2).
    ``scaling`` is ``None`` or ``"yarn"`` (DeepSeek-V2, arXiv 2309.00071). The YaRN fields read as
    transformers' ``_compute_yarn_parameters`` reads them: ``beta_fast``/``beta_slow`` 32/1 when
    left out (or 0); ``mscale``/``mscale_all_dim`` 0 when left out, and the cos/sin factor is
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) only when both are non-zero, else
    mscale(factor); ``attention_factor``, when given, is that factor itself; ``truncate`` (default
    True) rounds the correction range to whole dimensions; ``original_max_position_embeddings``
    defaults to the config's ``max_position_embeddings``.
    """

    dim: int
    theta: float
    interleaved: bool = False
    scaling: str | None = None
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class AttentionConfig:
    """Attention shape. ``kind`` is ``"gqa"`` or ``"mla"``.

    For MLA the cache holds one latent "head" per token of ``kv_lora_rank + qk_rope_head_dim``
    values; ``head_dim`` is the query/key head size ``qk_nope_head_dim + qk_rope_head_dim``.
    ``softmax_scale`` already contains YaRN's mscale² where it applies. ``latent_norm_eps``: the
    epsilon of MLA's ``q_a_layernorm`` and ``kv_a_layernorm`` (transformers: always 1e-6, whatever
    ``rms_norm_eps`` is).
    """

    kind: str
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    softmax_scale: float
    qk_norm: bool = False
    sliding_window: int | None = None
    bias: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    latent_norm_eps: float = MLA_LATENT_NORM_EPS


@dataclass(frozen=True)
class MoEConfig:
    """Routed/shared experts. ``moe_layers`` lists the layer ids whose MLP is an MoE block;
    the other layers use a dense MLP of ``dense_intermediate_size``.

    ``norm_topk_prob``: renormalise the top-k softmax weights to sum to one.
    ``routed_scaling_factor``: DeepSeek-V2 multiplies routed weights by it.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_shared_experts: int
    moe_layers: tuple[int, ...]
    dense_intermediate_size: int
    expert_names: tuple[str, str, str]  # (gate, up, down) parameter names in the checkpoint
    block_name: str  # "mlp" or "block_sparse_moe"


@dataclass(frozen=True)
class KVLayout:
    """What one cached token of one layer holds.

    GQA: K ``[kv_heads, k_dim]`` and V ``[kv_heads, v_dim]``, separate tensors.
    MLA: one latent ``[1, k_dim]`` (``kv_lora_rank + qk_rope_head_dim``); V is its first
    ``v_dim`` (= ``kv_lora_rank``) values (``shared_kv=True``).
    """

    kv_heads: int
    k_dim: int
    v_dim: int
    shared_kv: bool

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes one token occupies in one layer's cache."""
        v = 0 if self.shared_kv else self.v_dim
        return self.kv_heads * (self.k_dim + v) * dtype_bytes


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about one checkpoint's architecture."""

    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    attention: AttentionConfig
    rope: RopeConfig
    moe: MoEConfig
    hf_config_json: str  # the exact config.json text, for writing checkpoints back

    @property
    def kv_layout(self) -> KVLayout:
        a = self.attention
        if a.kind == "mla":
            return KVLayout(1, a.kv_lora_rank + a.qk_rope_head_dim, a.kv_lora_rank, True)
        return KVLayout(a.kv_heads, a.head_dim, a.head_dim, False)

    def hf_dict(self) -> dict[str, Any]:
        """A fresh copy of the HF config dict (for writing ``config.json``)."""
        return json.loads(self.hf_config_json)

    def with_overrides(self, **hf_fields: Any) -> "ModelConfig":
        """A new config with some HF fields replaced, e.g. ``norm_topk_prob=False``."""
        d = self.hf_dict()
        d.update(hf_fields)
        return ModelConfig.from_hf(d)

    @staticmethod
    def from_file(path: str | Path) -> "ModelConfig":
        """Read ``config.json`` (or a directory holding one).

        Raises:
            FileNotFoundError: no config.json there.
            ValueError: invalid JSON, unsupported ``model_type`` or a missing field.
        """
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json at {p}: pass a Hugging Face checkpoint directory")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ValueError(f"{p} holds a JSON {type(d).__name__}, not an object: pass a Hugging Face checkpoint's config.json")
        try:
            return ModelConfig.from_hf(d)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from e

    @staticmethod
    def from_hf(d: Mapping[str, Any]) -> "ModelConfig":
        """Normalise a HF config dict.

        Raises:
            ValueError: unsupported ``model_type`` or a required field missing (named).
        """
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {mt!r}; WriteScope supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        builder = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "deepseek_v2": _deepseek_v2}[mt]
        return builder(_Fields(d, mt))


class _Fields:
    """Typed access to a HF config dict: a field left out (or null) takes transformers' default
    (:data:`HF_DEFAULTS`); one without a default raises ValueError naming it."""

    _NO_DEFAULT = object()

    def __init__(self, d: Mapping[str, Any], model_type: str):
        self.d = d
        self.model_type = model_type
        self.defaults = HF_DEFAULTS[model_type]

    def req(self, name: str) -> Any:
        v = self.d.get(name)
        if v is None:
            v = self.defaults.get(name)
        if v is None:
            raise ValueError(f"config.json for model_type {self.model_type!r} is missing required field {name!r} "
                             "(transformers has no default for it either)")
        return v

    def opt(self, name: str, default: Any = _NO_DEFAULT) -> Any:
        """The field, else transformers' default, else ``default`` (None when not given)."""
        v = self.d.get(name)
        if v is None:
            v = self.defaults.get(name, None if default is self._NO_DEFAULT else default)
        return v


def _eos(f: _Fields) -> tuple[int, ...]:
    e = f.opt("eos_token_id")
    if e is None:
        return ()
    return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)


def _common(f: _Fields, attention: AttentionConfig, rope: RopeConfig, moe: MoEConfig) -> ModelConfig:
    arch = f.opt("architectures", [""])
    return ModelConfig(
        model_type=f.model_type,
        architecture=arch[0] if arch else "",
        vocab_size=int(f.req("vocab_size")),
        hidden_size=int(f.req("hidden_size")),
        num_layers=int(f.req("num_hidden_layers")),
        max_position_embeddings=int(f.req("max_position_embeddings")),
        rms_norm_eps=float(f.req("rms_norm_eps")),
        tie_word_embeddings=bool(f.opt("tie_word_embeddings")),
        bos_token_id=f.opt("bos_token_id"),
        eos_token_ids=_eos(f),
        torch_dtype=str(f.opt("torch_dtype", f.opt("dtype", "bfloat16"))),
        attention=attention,
        rope=rope,
        moe=moe,
        hf_config_json=json.dumps(dict(f.d), sort_keys=True),
    )


def _gqa(f: _Fields, qk_norm: bool, sliding_window: int | None, bias: bool) -> AttentionConfig:
    hidden, q_heads = int(f.req("hidden_size")), int(f.req("num_attention_heads"))
    head_dim = int(f.opt("head_dim", hidden // q_heads))
    return AttentionConfig(
        kind="gqa",
        q_heads=q_heads,
        kv_heads=int(f.opt("num_key_value_heads", q_heads)),
        head_dim=head_dim,
        v_head_dim=head_dim,
        softmax_scale=head_dim**-0.5,
        qk_norm=qk_norm,
        sliding_window=sliding_window,
        bias=bias,
    )


def _rope_fields(f: _Fields) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either the classic ``rope_theta`` + ``rope_scaling``
    fields or transformers 5's ``rope_parameters`` (which holds ``rope_theta`` itself)."""
    params = f.opt("rope_parameters")
    if params:
        theta = params.get("rope_theta")
        theta = float(f.opt("rope_theta") if theta is None else theta)
        kind = params.get("rope_type", params.get("type", "default"))
        return theta, (None if kind in (None, "default") else dict(params))
    rs = f.opt("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) in (None, "default"):
        rs = None
    return float(f.opt("rope_theta")), rs


def _plain_rope(f: _Fields, dim: int) -> RopeConfig:
    theta, rs = _rope_fields(f)
    if rs:
        raise ValueError(
            f"rope scaling {rs!r} is not supported for model_type {f.model_type!r}; remove it or use the default rope"
        )
    return RopeConfig(dim=dim, theta=theta)


def _qwen3_moe(f: _Fields) -> ModelConfig:
    sw = f.opt("sliding_window") if f.opt("use_sliding_window") else None
    att = _gqa(f, qk_norm=True, sliding_window=int(sw) if sw else None, bias=bool(f.opt("attention_bias")))
    n_layers = int(f.req("num_hidden_layers"))
    step, only = int(f.req("decoder_sparse_step")), set(f.opt("mlp_only_layers"))
    use_local = f.d.get("num_experts") is None and f.d.get("num_local_experts") is not None
    n_exp = int(f.d["num_local_experts"] if use_local else f.req("num_experts"))  # a missing field is named as Qwen3 spells it
    moe_layers = tuple(i for i in range(n_layers) if i not in only and n_exp > 0 and (i + 1) % step == 0)
    moe = MoEConfig(
        num_experts=n_exp,
        top_k=int(f.req("num_experts_per_tok")),
        intermediate_size=int(f.req("moe_intermediate_size")),
        norm_topk_prob=bool(f.opt("norm_topk_prob")),
        routed_scaling_factor=1.0,
        n_shared_experts=0,
        moe_layers=moe_layers,
        dense_intermediate_size=int(f.req("intermediate_size")),
        expert_names=("gate_proj", "up_proj", "down_proj"),
        block_name="mlp",
    )
    return _common(f, att, _plain_rope(f, att.head_dim), moe)


def _mixtral(f: _Fields) -> ModelConfig:
    sw = f.opt("sliding_window")
    # transformers' MixtralAttention has no biases whatever attention_bias says
    att = _gqa(f, qk_norm=False, sliding_window=int(sw) if sw else None, bias=False)
    moe = MoEConfig(
        num_experts=int(f.req("num_local_experts")),
        top_k=int(f.req("num_experts_per_tok")),
        intermediate_size=int(f.req("intermediate_size")),
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        n_shared_experts=0,
        moe_layers=tuple(range(int(f.req("num_hidden_layers")))),
        dense_intermediate_size=int(f.req("intermediate_size")),
        expert_names=("w1", "w3", "w2"),
        block_name="block_sparse_moe",
    )
    return _common(f, att, _plain_rope(f, att.head_dim), moe)


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """YaRN attention scale 0.1·mscale·ln(scale) + 1 (DeepSeek-V2 modeling code; arXiv 2309.00071)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(f: _Fields, rs: Mapping[str, Any], dim: int, theta: float) -> RopeConfig:
    """The YaRN rope of a rope-scaling dict, its left-out keys completed as transformers 5.17 does
    (``standardize_rope_params`` and ``_compute_yarn_parameters``; see :class:`RopeConfig`).

    Raises:
        ValueError: a rope type other than yarn, or no ``factor`` key (transformers fails on it too).
    """
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {kind!r} is not supported for {f.model_type}; only 'yarn' is")
    orig = rs.get("original_max_position_embeddings")
    orig = int(f.req("max_position_embeddings") if orig is None else orig)
    if "factor" not in rs:
        raise ValueError(f"rope_scaling {dict(rs)!r} has no 'factor', which yarn requires (transformers too): add it, "
                         "e.g. max_position_embeddings / original_max_position_embeddings")
    factor = rs["factor"]
    if factor is None:  # transformers: the ratio of the context lengths
        if rs.get("mscale_all_dim"):
            raise ValueError("rope_scaling 'factor' is null while 'mscale_all_dim' is set: transformers cannot scale the "
                             "attention then either; give the factor")
        factor = int(f.req("max_position_embeddings")) / orig
    af = rs.get("attention_factor")
    return RopeConfig(
        dim=dim,
        theta=theta,
        interleaved=True,
        scaling="yarn",
        factor=float(factor),
        original_max_position_embeddings=orig,
        beta_fast=float(rs.get("beta_fast") or 32),  # transformers: `or`, so 0 also means the default
        beta_slow=float(rs.get("beta_slow") or 1),
        mscale=float(rs.get("mscale") or 0),
        mscale_all_dim=float(rs.get("mscale_all_dim") or 0),
        attention_factor=None if af is None else float(af),
        truncate=bool(rs.get("truncate", True)),
    )


def _deepseek_v2(f: _Fields) -> ModelConfig:
    if f.opt("topk_method", "greedy") != "greedy":
        raise ValueError(f"topk_method {f.d.get('topk_method')!r} is not supported; only 'greedy' (DeepSeek-V2) is")
    if f.opt("scoring_func", "softmax") != "softmax":
        raise ValueError(f"scoring_func {f.d.get('scoring_func')!r} is not supported; only 'softmax' is")
    nope, rope_d = int(f.req("qk_nope_head_dim")), int(f.req("qk_rope_head_dim"))
    q_head_dim = nope + rope_d
    scale = q_head_dim**-0.5
    theta, rs = _rope_fields(f)
    rope = RopeConfig(dim=rope_d, theta=theta, interleaved=True)
    if rs:
        rope = _yarn(f, rs, rope_d, theta)
        if rope.mscale_all_dim:  # transformers' yarn_apply_mscale: from the dict's own factor
            m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
            scale = scale * m * m
    q_heads = int(f.req("num_attention_heads"))
    # left out: transformers' 1536; null: no query compression (DeepSeek-V2-Lite)
    q_lora = f.d["q_lora_rank"] if "q_lora_rank" in f.d else f.opt("q_lora_rank")
    q_lora_rank = None if q_lora is None else int(q_lora)
    att = AttentionConfig(
        kind="mla",
        q_heads=q_heads,
        kv_heads=q_heads,
        head_dim=q_head_dim,
        v_head_dim=int(f.req("v_head_dim")),
        softmax_scale=scale,
        bias=bool(f.opt("attention_bias")),
        q_lora_rank=q_lora_rank,
        kv_lora_rank=int(f.req("kv_lora_rank")),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_d,
    )
    n_layers, n_routed = int(f.req("num_hidden_layers")), int(f.req("n_routed_experts"))
    first_dense = int(f.req("first_k_dense_replace"))
    if int(f.opt("moe_layer_freq", 1)) != 1:  # DeepSeek's own modeling code reads it; transformers 5.17 does not
        raise ValueError(f"moe_layer_freq {f.d['moe_layer_freq']!r} is not supported: transformers 5.17 makes every layer "
                         "from first_k_dense_replace on an MoE layer (moe_layer_freq 1); set it to 1 if the checkpoint has that layout")
    moe = MoEConfig(
        num_experts=n_routed,
        top_k=int(f.req("num_experts_per_tok")),
        intermediate_size=int(f.req("moe_intermediate_size")),
        norm_topk_prob=bool(f.opt("norm_topk_prob")),
        routed_scaling_factor=float(f.req("routed_scaling_factor")),
        n_shared_experts=int(f.req("n_shared_experts")),
        moe_layers=tuple(i for i in range(n_layers) if n_routed > 0 and i >= first_dense),
        dense_intermediate_size=int(f.req("intermediate_size")),
        expert_names=("gate_proj", "up_proj", "down_proj"),
        block_name="mlp",
    )
    return _common(f, att, rope, moe)
