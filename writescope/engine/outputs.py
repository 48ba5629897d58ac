"""What ``LLM.generate`` returns: per prompt, its choices' tokens, text and metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from writescope.engine.logprobs import TokenLogprobs


@dataclass
class RequestMetrics:
    """Timings of one request (seconds unless named otherwise).

    ``ttft_s``: from the start of ``generate`` to this request's first token (includes the
    prefill of the whole batch). ``tpot_s``: mean time per output token after the first.
    ``prefill_tok_s`` / ``decode_tok_s``: batch-wide throughput (tokens per second) of the
    prefill phase and of the decode phase (from the first token to the last: the requests that
    finish before the last one free their KV inside it; those freed after the last token are
    timed by ``LLM.release_s``). ``peak_memory_bytes``: peak device memory
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
class CompletionOutput:
    """One choice of a request (vLLM's ``CompletionOutput``).

    ``finish_reason`` is ``"stop"`` (an end or stop token, or a stop string: ``text`` ends before
    it, or after it with ``SamplingParams.include_stop_str_in_output``) or ``"length"``.
    ``stop_reason`` (vLLM's): the stop string that ended the text, or the token of
    ``SamplingParams.stop_token_ids`` that ended it; None otherwise (an end-of-sequence token, a
    length limit). ``token_ids`` keep every generated token, the one completing a stop string
    included.

    ``cumulative_logprob`` (vLLM's): with ``SamplingParams.logprobs``, the sum of the sampled
    tokens' logprobs (natural log, under the raw logits: ``sum(lp.logprob for lp in logprobs)``,
    over every token of ``token_ids``), the log-probability of the whole output; None without.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    #: with ``SamplingParams.logprobs``: one :class:`~writescope.engine.logprobs.TokenLogprobs`
    #: per token of ``token_ids``; else None
    logprobs: list[TokenLogprobs] | None = field(default=None, repr=False)
    #: with ``SamplingParams.logprobs``: the sum of ``logprobs``' ``logprob`` (natural log); else None
    cumulative_logprob: float | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    #: tokens of this choice's KV per region when it finished (``window``, ``compute``,
    #: ``load``); None under the ``resident`` policy
    kv_placement: dict[str, int] | None = field(default=None, repr=False)


@dataclass
class RequestOutput:
    """One finished prompt: ``outputs`` holds its ``SamplingParams.n`` choices
    (:class:`CompletionOutput`, by index: vLLM's shape). The fields beside it are choice 0's
    (with ``n == 1`` the only one), so ``out.text`` reads as ``out.outputs[0].text``; see
    :class:`CompletionOutput` for ``finish_reason``, ``stop_reason`` and ``cumulative_logprob``."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics = field(repr=False)
    #: choice 0's KV per region when it finished (``window``, ``compute``, ``load``); None under
    #: the ``resident`` policy
    kv_placement: dict[str, int] | None = field(default=None, repr=False)
    #: choice 0's logprobs (with ``SamplingParams.logprobs``; else None)
    logprobs: list[TokenLogprobs] | None = field(default=None, repr=False)
    stop_reason: str | int | None = None
    #: choice 0's sum of its tokens' logprobs (with ``SamplingParams.logprobs``; else None)
    cumulative_logprob: float | None = None
    #: every choice, by index (``outputs[0]`` is the fields above)
    outputs: list[CompletionOutput] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, request_id: int, prompt: str | None, prompt_token_ids: list[int],
           choices: list[CompletionOutput]) -> "RequestOutput":
        """The output of a prompt and its ``choices`` (at least one, by index)."""
        c = choices[0]
        return cls(request_id, prompt, prompt_token_ids, c.token_ids, c.text, c.finish_reason, c.metrics, c.kv_placement,
                   c.logprobs, c.stop_reason, c.cumulative_logprob, list(choices))

    def to_dict(self) -> dict:
        return asdict(self)
