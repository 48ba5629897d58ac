"""Attention projections: GQA (Qwen3-MoE, Mixtral) and MLA with absorbed weights (DeepSeek-V2).

Both hand their queries and new KV to a :class:`writescope.kvcache.KVCache` and project the
result back. Shapes: T packed tokens, Hq query heads, Hkv KV heads, d head_dim.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from writescope.attention.metadata import ForwardBatch
from writescope.attention.reference import attend_sequence
from writescope.config import AttentionConfig
from writescope.kvcache.base import KVCache
from writescope.layers.norm import RMSNorm
from writescope.layers.rope import RotaryEmbedding


class GQAAttention(nn.Module):
    """Grouped-query attention; optional per-head q/k RMSNorm before rope (Qwen3).

    Parameter names follow HF: q_proj, k_proj, v_proj, o_proj, q_norm, k_norm.
    """

    def __init__(self, cfg: AttentionConfig, hidden: int, eps: float, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        d = cfg.head_dim
        self.q_proj = nn.Linear(hidden, cfg.q_heads * d, bias=cfg.bias)
        self.k_proj = nn.Linear(hidden, cfg.kv_heads * d, bias=cfg.bias)
        self.v_proj = nn.Linear(hidden, cfg.kv_heads * d, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.q_heads * d, hidden, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, eps)
            self.k_norm = RMSNorm(d, eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``."""
        return self.begin(x, rope, cos_sin, batch, cache)()

    def begin(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin, batch: ForwardBatch, cache: KVCache):
        """Issue the projections and the cache's attention (``attend_begin``); returns the
        function that finishes the layer (``attend_end``, o_proj) and gives ``[T, hidden]``."""
        pending = self.attend_begin(cache, self.project(x, rope, cos_sin), batch)
        return lambda: self.output(cache.attend_end(pending))

    def project(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin) -> tuple:
        """``(q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d])`` of x ``[T, hidden]``, normed and
        rotated: what the cache takes. Tensor work only (a decode CUDA graph captures it)."""
        c, T = self.cfg, x.shape[0]
        q = self.q_proj(x).view(T, c.q_heads, c.head_dim)  # [T, Hq, d]
        k = self.k_proj(x).view(T, c.kv_heads, c.head_dim)  # [T, Hkv, d]
        v = self.v_proj(x).view(T, c.kv_heads, c.head_dim)  # [T, Hkv, d]
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope.apply(q, *cos_sin), rope.apply(k, *cos_sin), v

    def attend_begin(self, cache: KVCache, qkv: tuple, batch: ForwardBatch):
        """``cache.attend_begin`` of this layer for :meth:`project`'s output."""
        return cache.attend_begin(self.layer_id, *qkv, batch, self.cfg.softmax_scale, self.cfg.sliding_window)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output ``[T, Hq, d]`` -> ``[T, hidden]`` (o_proj)."""
        return self.o_proj(o.reshape(o.shape[0], -1))


MLA_PREFILL_MODES = ("absorbed", "expanded")


def mla_prefill_mode() -> str:
    """How MLA attends in prefill: ``WRITESCOPE_MLA_PREFILL`` = ``expanded`` (default) or
    ``absorbed``.

    Raises:
        ValueError: another value.
    """
    mode = os.environ.get("WRITESCOPE_MLA_PREFILL", "expanded").strip().lower()
    if mode not in MLA_PREFILL_MODES:
        raise ValueError(f"WRITESCOPE_MLA_PREFILL={mode!r}: use one of {', '.join(MLA_PREFILL_MODES)}")
    return mode


class MLAAttention(nn.Module):
    """DeepSeek-V2 multi-head latent attention, caching the compressed latent.

    Cached per token: ``[kv_a_layernorm(c_kv) (kv_lora_rank) | rope(k_pe) (qk_rope_head_dim)]``.
    Decode uses the absorbed form (DeepSeek-V2 paper, arXiv 2405.04434 §2.1.2):
    q_lat = q_nope · W_UK (per head, ``[T, H, kv_lora_rank]``), scores = [q_lat | q_pe] · latent,
    o_lat = softmax · c_kv, o = o_lat · W_UVᵀ. ``W_UK``/``W_UV`` are the two halves of
    ``kv_b_proj.weight`` viewed as ``[H, nope + v, kv_lora_rank]``.

    Prefill by default (``WRITESCOPE_MLA_PREFILL=expanded``) instead expands each sequence's
    cached latent to per-head keys ``[k_nope | k_pe]`` (nope + rope wide)
    and values (v wide), as transformers' ``modeling_deepseek_v2`` does for every step: the
    scores take nope + rope multiply-adds per key and head instead of kv_lora_rank + rope
    (192 against 576 for DeepSeek-V2-Lite), at the cost of expanding the context each chunk, and
    SDPA's fused kernels take those widths. On the H200, DeepSeek-V2-Lite, 2 x 32K prompts in
    2,048-token chunks: 10,401 tok/s expanded against 2,403 tok/s absorbed, the same 4 greedy tokens
    for both prompts (``benchmarks/results/e2e.md``). ``WRITESCOPE_MLA_PREFILL=absorbed`` keeps the decode form in
    prefill too. Both are exact.
    """

    def __init__(self, cfg: AttentionConfig, hidden: int, eps: float, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        H = cfg.q_heads
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * cfg.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=cfg.bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``."""
        return self.begin(x, rope, cos_sin, batch, cache)()

    def begin(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin, batch: ForwardBatch, cache: KVCache):
        """As :meth:`GQAAttention.begin`: issues up to the cache's ``attend_begin``; the returned
        function finishes the layer and gives ``[T, hidden]``."""
        if not all(n == 1 for n in batch.query_lens) and mla_prefill_mode() == "expanded":
            out = self._expanded_prefill(x, rope, cos_sin, batch, cache)
            return lambda: out
        pending = self.attend_begin(cache, self.project(x, rope, cos_sin), batch)
        return lambda: self.output(cache.attend_end(pending))

    def _parts(self, x, rope, cos_sin):
        """q_nope ``[T, H, nope]``, rotated q_pe ``[T, H, r]``, the cache entry ``[T, 1, R + r]``."""
        c, T, H = self.cfg, x.shape[0], self.cfg.q_heads
        nope, r, R = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, nope + r)
        q_nope, q_pe = q[..., :nope], q[..., nope:]  # [T, H, nope], [T, H, r]
        kv = self.kv_a_proj_with_mqa(x)  # [T, R + r]
        latent = self.kv_a_layernorm(kv[:, :R])  # [T, R]
        k_pe = rope.apply(kv[:, None, R:], *cos_sin)  # [T, 1, r]
        entry = torch.cat((latent[:, None, :], k_pe), dim=-1)  # [T, 1, R + r]
        return q_nope, rope.apply(q_pe, *cos_sin), entry

    def _w_uk_uv(self):
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.q_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]  # [H, nope, R], [H, v, R]

    def project(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin) -> tuple:
        """``(q_full [T, H, R + r], entry [T, 1, R + r], None)``: the absorbed query and the new
        latent, what the cache takes. Tensor work only (a decode CUDA graph captures it)."""
        q_nope, q_pe, entry = self._parts(x, rope, cos_sin)
        q_lat = torch.einsum("thn,hnr->thr", q_nope, self._w_uk_uv()[0])  # [T, H, R]
        return torch.cat((q_lat, q_pe), dim=-1), entry, None

    def attend_begin(self, cache: KVCache, qkv: tuple, batch: ForwardBatch):
        """``cache.attend_begin`` of this layer for :meth:`project`'s output."""
        return cache.attend_begin(self.layer_id, *qkv, batch, self.cfg.softmax_scale)

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Latent attention output ``[T, H, R]`` -> ``[T, hidden]`` (W_UV, then o_proj)."""
        o = torch.einsum("thr,hvr->thv", o_lat, self._w_uk_uv()[1])  # [T, H, v]
        return self.o_proj(o.reshape(o.shape[0], -1))

    def _expanded_prefill(self, x, rope, cos_sin, batch, cache) -> torch.Tensor:
        c, T, H, R = self.cfg, x.shape[0], self.cfg.q_heads, self.cfg.kv_lora_rank
        q_nope, q_pe, entry = self._parts(x, rope, cos_sin)
        w_uk, w_uv = self._w_uk_uv()
        q_exp = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, nope + r]

        def expanded(q_rows, keys, vals, context_len, scale):  # keys: [K, 1, R + r] cached + new latents
            lat, kpe = keys[:, 0, :R], keys[:, 0, R:]
            k_full = torch.cat((torch.einsum("kr,hnr->khn", lat, w_uk), kpe[:, None, :].expand(-1, H, -1)), dim=-1)
            v_full = torch.einsum("kr,hvr->khv", lat, w_uv)  # [K, H, v]
            return attend_sequence(q_rows, k_full, v_full, context_len, scale)  # [rows, H, v]

        o = cache.attend(self.layer_id, q_exp, entry, None, batch, c.softmax_scale, prefill_attn=expanded)  # [T, H, v]
        return self.o_proj(o.reshape(T, H * c.v_head_dim))
