"""What ``LLM.generate`` returns: per-request tokens, text and metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from writescope.engine.logprobs import TokenLogprobs


@dataclass
class RequestMetrics:
    """Timings of one request (seconds unless named otherwise).

    ``ttft_s``: from the start of ``generate`` to this request's first token (includes the
    prefill of the whole batch). ``tpot_s``: mean time per output token after the first.
    ``prefill_tok_s`` / ``decode_tok_s``: batch-wide throughput (tokens per second) of the
    prefill phase and of the decode phase. ``peak_memory_bytes``: peak device memory
    (CUDA allocator) or peak process RSS (CPU).
    """

    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_tok_s: float
    decode_tok_s: float
    peak_memory_bytes: int


@dataclass
class RequestOutput:
    """One finished request. ``finish_reason`` is ``"stop"`` (end or stop token, or a stop string:
    ``text`` ends before it) or ``"length"``."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics = field(repr=False)
    #: tokens of this request's KV per region when it finished (``window``, ``compute``,
    #: ``load``); None under the ``resident`` policy
    kv_placement: dict[str, int] | None = field(default=None, repr=False)
    #: with ``SamplingParams.logprobs``: one :class:`~writescope.engine.logprobs.TokenLogprobs`
    #: per token of ``token_ids``; else None
    logprobs: list[TokenLogprobs] | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return asdict(self)
