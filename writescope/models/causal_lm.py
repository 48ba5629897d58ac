"""The decoder-only causal LM shared by all three architectures.

Module names mirror Hugging Face, so ``state_dict()`` keys equal the checkpoint's tensor names:
``model.embed_tokens``, ``model.layers.{i}.{input_layernorm,self_attn,post_attention_layernorm,
<mlp block>}``, ``model.norm``, ``lm_head``. The per-model files only choose the attention and
MLP of each layer.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from writescope.attention.metadata import ForwardBatch
from writescope.config import ModelConfig
from writescope.kvcache.base import KVCache
from writescope.layers.norm import RMSNorm
from writescope.layers.rope import RotaryEmbedding
from writescope.models.decode_step import DecodeStep

LayerParts = tuple[nn.Module, nn.Module]  # (attention, mlp) of one decoder layer


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module, mlp_name: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)

    @property
    def mlp_module(self) -> nn.Module:
        """The MLP (a ``GatedMLP`` or a ``SparseMoeBlock``), whatever the checkpoint calls it."""
        return getattr(self, self.mlp_name)

    def forward(self, x, rope, cos_sin, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        return self.begin(x, rope, cos_sin, batch, cache)()

    def begin(self, x, rope, cos_sin, batch: ForwardBatch, cache: KVCache) -> Callable[[], torch.Tensor]:
        """Issue the layer up to its cache attention (``attend_begin``); the returned function
        finishes it (attention output, residual, MLP) and gives the layer's output."""
        attn = self.self_attn.begin(self.input_layernorm(x), rope, cos_sin, batch, cache)
        return lambda: self._mlp_residual(x + attn())

    def pre(self, x, rope, cos_sin) -> tuple:
        """What the layer hands its cache for ``x`` ``[T, hidden]``: ``self_attn.project`` of the
        normed input (decode steps, models/decode_step.py)."""
        return self.self_attn.project(self.input_layernorm(x), rope, cos_sin)

    def post(self, x, o) -> torch.Tensor:
        """The layer's output from its input ``x`` and its cache's attention output ``o``."""
        h, n = self.post_begin(x, o)
        return h + self.mlp_out(n)

    def _mlp_residual(self, h) -> torch.Tensor:
        return h + getattr(self, self.mlp_name)(self.post_attention_layernorm(h))

    def post_begin(self, x, o) -> tuple:
        """:meth:`post` up to its MLP: ``(h, n)``, the residual stream ``h = x + output(o)`` and the
        MLP's input ``n`` (its normed ``h``); the layer's output is ``h + mlp_out(n)`` (:meth:`post`;
        a stage cut around an MLP that runs outside its graphs, models/decode_step.py)."""
        h = x + self.self_attn.output(o)
        return h, self.post_attention_layernorm(h)

    def mlp_out(self, n) -> torch.Tensor:
        """The MLP (or MoE block) of the normed residual stream ``n`` (see :meth:`post_begin`)."""
        return getattr(self, self.mlp_name)(n)

    def graph_key(self, tokens: int | None = None):
        """What a CUDA graph of :meth:`post` at ``tokens`` tokens depends on beyond shapes, or None
        when it cannot be captured (an MLP that reads routing back to the host): see models/graphs.py."""
        mlp = self.mlp_module
        return mlp.graph_key(tokens) if hasattr(mlp, "graph_key") else ()


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, build_layer: Callable[[ModelConfig, int], LayerParts]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, *build_layer(cfg, i), mlp_name=cfg.moe.block_name if i in cfg.moe.moe_layers else "mlp")
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Embeddings -> decoder layers -> final norm -> lm_head, over a packed ragged batch."""

    def __init__(self, cfg: ModelConfig, build_layer: Callable[[ModelConfig, int], LayerParts]):
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg, build_layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.rope)
        self.decode = DecodeStep(self)  # decode passes: micro-batches and CUDA graphs (models/decode_step.py)

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        all_logits: bool = False,
        layer_callback: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one pass and write the new KV into ``cache``.

        Args:
            input_ids: ``[T]`` int64 packed new tokens (see :class:`ForwardBatch`).
            batch: ragged metadata.
            cache: KV cache holding ``batch.context_lens`` tokens per slot.
            all_logits: return logits for every token (``[T, vocab]``) instead of each
                sequence's last token (``[batch, vocab]``).
            layer_callback: called with the layer id after each layer (progress bars).

        Returns:
            float32 logits.
        """
        if not all_logits and batch.slots and all(n == 1 for n in batch.query_lens):  # decode
            return self.decode.run(input_ids, batch, cache, layer_callback)
        x = self.model.embed_tokens(input_ids)  # [T, D]
        cos_sin = self.rope.cos_sin(batch.positions)  # 2 x [T, rope_dim/2] f32
        for i, layer in enumerate(self.model.layers):
            x = layer(x, self.rope, cos_sin, batch, cache)
            if layer_callback is not None:
                layer_callback(i)
        return self._logits(x, batch, all_logits)

    def _logits(self, x: torch.Tensor, batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        if not all_logits and batch.num_tokens != len(batch.slots):  # (decode: every token is its sequence's last; an
            x = x[batch.last_token_indices()]  # [B, D]                 index list would be a host-to-device copy, a wait)
        return self.lm_head(self.model.norm(x)).float()

    @torch.inference_mode()
    def forward_by_layer(
        self,
        passes: list[tuple[torch.Tensor, ForwardBatch]],
        cache: KVCache,
        layer_callback: Callable[[int], None] | None = None,
    ) -> list[torch.Tensor]:
        """Run several prefill passes layer by layer: layer l of every pass (in their order) before
        layer l + 1 of any. The same operations on the same inputs per pass as :meth:`forward`
        pass after pass, so the same logits; a cache that keeps a layer's KV on the device between
        passes (``keeping_prefill_kv``) then reads none of the group's earlier passes' KV back
        (engine/prefill_order.py; what a sequence brought from an earlier group it still reads).

        Args:
            passes: ``(input_ids [T_k] int64, batch_k)`` in the order :meth:`forward` would run them;
                no pass may be decode-shaped (every sequence one new token: :meth:`forward` runs
                those as decode steps).
            cache: KV cache holding each pass's ``context_lens`` once the passes before it ran.
            layer_callback: called with the layer id once every pass has run it.

        Returns:
            Per pass, float32 logits of each sequence's last new token ``[B_k, vocab]``.

        Raises:
            ValueError: a decode-shaped pass.
        """
        for _, batch in passes:
            if batch.slots and all(n == 1 for n in batch.query_lens):
                raise ValueError("forward_by_layer: a pass whose every sequence has one new token is a decode step; run it with forward")
        xs = [self.model.embed_tokens(ids) for ids, _ in passes]
        cos_sins = [self.rope.cos_sin(batch.positions) for _, batch in passes]
        # per pass, the sequences with a pass after it in the group: only theirs is worth keeping
        later = [set().union(*(b.slots for _, b in passes[k + 1 :])) for k in range(len(passes))]
        keep = getattr(cache, "keeping_prefill_kv", None)
        with keep() if keep is not None else contextlib.nullcontext():
            for i, layer in enumerate(self.model.layers):
                for k, (_, batch) in enumerate(passes):
                    if keep is not None:
                        cache.keep_for(later[k])
                    xs[k] = layer(xs[k], self.rope, cos_sins[k], batch, cache)
                if layer_callback is not None:
                    layer_callback(i)
        return [self._logits(x, batch, False) for x, (_, batch) in zip(xs, passes)]
