"""Sampling parameters (shaped like vLLM's ``SamplingParams``) and the sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from writescope.errors import ArgError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Attributes:
        max_tokens: new tokens to generate per request (>= 1).
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass in (0, 1]; 1 keeps the whole distribution.
        seed: per-request random seed (sampling only); ``None`` uses the engine seed + index.
        ignore_eos: keep generating after an end-of-sequence token (benchmarks).
        stop_token_ids: extra token ids that end a request.

    Raises:
        ValueError: on construction, for any value outside the ranges above.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ArgError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not self.temperature >= 0:
            raise ArgError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}", "temperature")
        if not 0 < self.top_p <= 1:
            raise ArgError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row.

    Args:
        logits: ``[batch, vocab]`` float32.
        params: sampling parameters per row.
        generators: a generator on ``logits.device`` per sampled row (``None`` for greedy rows).

    Returns:
        token ids, ``len == batch``.
    """
    out = logits.argmax(dim=-1)  # [B]
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)  # [V]
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=0) - sorted_p < p.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        out[i] = torch.multinomial(probs, 1, generator=g)[0]
    return out.tolist()
