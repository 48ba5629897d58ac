"""Sampling parameters (shaped like vLLM's ``SamplingParams``) and the sampler (with the sampled
tokens' logprobs, for the requests that ask: :mod:`writescope.engine.logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from writescope.engine.logprobs import MAX_LOGPROBS, TokenLogprobs, logprob_rows, unpack
from writescope.errors import ArgError

MAX_N = 16  # choices per prompt (SamplingParams.n; the server's ``n`` too)
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM's threshold)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Attributes:
        max_tokens: new tokens to generate per request (>= 1).
        temperature: 0 means greedy (argmax), and so does one below 1e-5 (GREEDY_BELOW); above, samples from softmax(logits / temperature).
        top_p: nucleus sampling mass in (0, 1]; 1 keeps the whole distribution.
        seed: per-request random seed (sampling only); ``None`` uses the engine seed + index.
        ignore_eos: keep generating after an end-of-sequence token (benchmarks).
        stop_token_ids: extra token ids that end a request (the output's ``stop_reason`` is the id).
        stop: strings that end a request (a string or a sequence of them, non-empty): its text
            ends before the first one it contains, or after it with
            ``include_stop_str_in_output`` (:mod:`writescope.engine.stop_strings`); finish_reason
            ``stop``, the output's ``stop_reason`` that string.
        logprobs: None: no logprobs; k in [0, MAX_LOGPROBS]: each generated token's logprob and
            the k most likely tokens' (log_softmax of the raw logits, before temperature:
            :mod:`writescope.engine.logprobs`).
        n: choices per prompt, in [1, MAX_N]: each its own request of the prompt, choice i
            sampled with ``seed + i`` when ``seed`` is given (:mod:`writescope.engine.choices`).
        include_stop_str_in_output: keep the stop string that ended the text in it (vLLM's
            extension; the text still ends at that string's end).

    Raises:
        ValueError: on construction, for any value outside the ranges above.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    n: int = 1
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ArgError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not self.temperature >= 0:
            raise ArgError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}", "temperature")
        if not 0 < self.top_p <= 1:
            raise ArgError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.stop is None:  # as vLLM: no stop strings
            object.__setattr__(self, "stop", ())
        if not isinstance(self.stop, (str, list, tuple)):
            raise ArgError(f"stop must be a string or a sequence of strings, got {self.stop!r}", "stop")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ArgError(f"stop strings must be non-empty strings, got {stop!r}", "stop")
        object.__setattr__(self, "stop", stop)
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ArgError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}", "logprobs")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ArgError(f"n (choices per prompt) must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed <= 2**64 - self.n):
            raise ArgError(f"seed must be an integer in [-2**63, 2**64 - n] (torch's generator seeds; choice i of n uses "
                           f"seed + i), got {self.seed!r}", "seed")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ArgError(f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}",
                           "include_stop_str_in_output")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below :data:`GREEDY_BELOW` (as vLLM: logits / a tiny temperature
        overflow to inf and softmax gives NaN, where the limit of sampling is the argmax)."""
        return self.temperature < GREEDY_BELOW


def _pick(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """The sampled ids, ``[batch]`` int64 on ``logits.device`` (not read back yet)."""
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
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row.

    Args:
        logits: ``[batch, vocab]`` float32.
        params: sampling parameters per row.
        generators: a generator on ``logits.device`` per sampled row (``None`` for greedy rows).

    Returns:
        token ids, ``len == batch``.
    """
    return _pick(logits, params, generators).tolist()


def sample_with_logprobs(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
                         ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """:func:`sample`, and for each row whose params ask (``logprobs`` not None) its token's
    logprobs (None for the others). The ids and the logprobs come back to the host in one copy,
    the one :func:`sample` makes anyway (:mod:`writescope.engine.logprobs`)."""
    toks = _pick(logits, params, generators)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return toks.tolist(), [None] * len(params)
    ks = [params[i].logprobs for i in rows]
    k = min(max(ks), logits.shape[-1])
    host = torch.cat([toks.double(), logprob_rows(logits, toks, rows, k).flatten()]).tolist()  # the one read-back
    ids = [int(t) for t in host[: len(params)]]
    lps: list[TokenLogprobs | None] = [None] * len(params)
    for row, lp in zip(rows, unpack(host[len(params) :], ids, rows, [min(x, k) for x in ks], k)):
        lps[row] = lp
    return ids, lps
