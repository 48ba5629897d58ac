"""One decode pass of a :class:`~writescope.models.causal_lm.CausalLM`: micro-batches and CUDA graphs.

The layers are cut at the cache (models/graphs.py): stage 0 is the embedding and layer 0's
``pre``; stage l (1 <= l < L) is layer l-1's ``post`` and layer l's ``pre``; stage L is the last
layer's ``post``, the final norm and the LM head. Between stage l and stage l+1 the cache attends
layer l (``attend_begin`` ... ``attend_end``).

When the cache asks for micro-batches (``decode_groups``: a step with a CPU part, if switched on), the batch's
sequences run as contiguous groups A, B whose layers interleave:

```
stage 0 A, begin A0, stage 0 B, begin B0 | end A0, stage 1 A, begin A1, end B0, stage 1 B, begin B1 | ...
```

so B's layer-l attention is queued (its CPU part included) before A's is waited for, and the CPU
attends one group while the device runs the other's stages. Every sequence's arithmetic is that of
the whole batch row by row, only split in two: the matrix products' shapes change, so results
agree within rounding, not bit for bit. Stages run as CUDA graphs where they can
(:class:`~writescope.models.graphs.StageGraphs`). A stage whose MLP cannot be captured (an MoE
block with host experts: its routing read back, or its CPU share handed to the native expert
worker, a host call) is cut around that MLP: the attention output, residual and norm before it and
the residual and the next layer's ``pre`` after it run as two graphs, the MLP eagerly between them,
the same ops in the same order as the whole stage (``WRITESCOPE_GRAPH_SPLIT``: ``on``, the default,
or ``off``: such a stage runs eagerly whole, as before). On an error the begun attentions are
waited for (``cache.abandon``) before it propagates.
"""

from __future__ import annotations

from typing import Callable

import torch

from writescope.attention.metadata import ForwardBatch
from writescope.env import env_choice
from writescope.kvcache.base import KVCache
from writescope.models.graphs import StageGraphs, graphs_wanted


def graph_split_wanted() -> bool:
    """``WRITESCOPE_GRAPH_SPLIT``: ``on`` (the default) cuts a stage whose MLP cannot be captured
    around it, ``off`` runs such a stage eagerly whole (read every decode pass).

    Raises:
        ValueError: another value than on/off (names it).
    """
    return env_choice("WRITESCOPE_GRAPH_SPLIT", ("on", "off")) == "on"


class DecodeStep:
    """Runs decode passes of ``model`` (see module doc); ``graphs`` is made on the first CUDA pass."""

    def __init__(self, model):
        self._model = [model]  # not a submodule
        self.graphs: StageGraphs | None = None
        self._graphs_checked = False
        self._fns: list[Callable] | None = None  # the L + 1 stage functions, made on the first pass
        self._cuts: list | None = None  # stage l >= 1 cut around layer l-1's MLP: (before, mlp, after)
        graphs_wanted(torch.device("cpu"))  # a bad WRITESCOPE_CUDA_GRAPHS fails here, when the model is built
        graph_split_wanted()

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: KVCache, layer_callback: Callable[[int], None] | None = None):
        """Logits ``[B, vocab]`` float32 of a decode pass (every query length 1)."""
        model = self._model[0]
        if not self._graphs_checked:
            self._graphs_checked = True
            if graphs_wanted(input_ids.device):
                self.graphs = StageGraphs()
        layers, rope = model.model.layers, model.rope
        L = len(layers)
        groups = cache.decode_groups(batch) or [(0, len(batch.slots))]
        cos, sin = rope.cos_sin(batch.positions)  # [B, rope_dim/2] each
        subs = [batch.sub(a, b) if len(groups) > 1 else batch for a, b in groups]
        ids = [input_ids[a:b] for a, b in groups]
        css = [(cos[a:b], sin[a:b]) for a, b in groups]
        if self._fns is None:
            self._fns = [self._stage_fn(model, l) for l in range(L + 1)]
            self._cuts = [None] + [self._cut_fns(model, l) for l in range(1, L + 1)]
        fns, cuts = self._fns, self._cuts
        # per micro-batch (its token count decides an MoE block's path); stage l's MLP is layer l-1's
        keys = None if self.graphs is None else [[()] + [layer.graph_key(b - a) for layer in layers] for a, b in groups]
        cut = keys is not None and graph_split_wanted()

        def stage(l, g, *inputs):
            if keys is None:
                return fns[l](*inputs)
            tokens = groups[g][1] - groups[g][0]
            if keys[g][l] is not None or not cut:
                return self.graphs.run(l, g, tokens, keys[g][l], fns[l], inputs)
            before, mlp, after = cuts[l]  # the MLP outside the graphs, the rest of the stage in two
            h, n = self.graphs.run((l, "before"), g, tokens, (), before, inputs[:2])
            return self.graphs.run((l, "after"), g, tokens, (), after, (h, mlp(n), *inputs[2:]))

        xs, pending, logits = [None] * len(groups), [None] * len(groups), [None] * len(groups)
        try:
            for g in range(len(groups)):
                xs[g], qkv = stage(0, g, ids[g], *css[g])
                pending[g] = layers[0].self_attn.attend_begin(cache, qkv, subs[g])
            for l in range(L):
                for g in range(len(groups)):
                    o = cache.attend_end(pending[g])
                    pending[g] = None
                    if l + 1 < L:
                        xs[g], qkv = stage(l + 1, g, xs[g], o, *css[g])
                        pending[g] = layers[l + 1].self_attn.attend_begin(cache, qkv, subs[g])
                    else:
                        logits[g] = stage(L, g, xs[g], o)
                if layer_callback is not None:
                    layer_callback(l)
        except BaseException:
            cache.abandon()
            raise
        if len(groups) > 1:
            return torch.cat(logits)
        return logits[0] if self.graphs is None else logits[0].clone()  # a graph's output is overwritten by its next replay

    @staticmethod
    def _stage_fn(model, l: int) -> Callable:
        layers, rope, L = model.model.layers, model.rope, len(model.model.layers)
        if l == 0:
            def first(ids, cos, sin):
                x = model.model.embed_tokens(ids)
                return x, layers[0].pre(x, rope, (cos, sin))

            return first
        if l < L:
            def middle(x, o, cos, sin):
                x = layers[l - 1].post(x, o)
                return x, layers[l].pre(x, rope, (cos, sin))

            return middle

        def last(x, o):
            return model.lm_head(model.model.norm(layers[L - 1].post(x, o))).float()

        return last

    @staticmethod
    def _cut_fns(model, l: int) -> tuple[Callable, Callable, Callable]:
        """Stage l (1 <= l <= L) cut around layer l-1's MLP: ``before(x, o) -> (h, n)``, ``mlp(n)``,
        ``after(h, y, *rest)``: what :meth:`_stage_fn`'s stage computes, op for op."""
        layers, rope, L = model.model.layers, model.rope, len(model.model.layers)
        prev = layers[l - 1]
        if l < L:
            def after(h, y, cos, sin):
                x = h + y
                return x, layers[l].pre(x, rope, (cos, sin))
        else:
            def after(h, y):
                return model.lm_head(model.model.norm(h + y)).float()
        return prev.post_begin, prev.mlp_out, after
