"""One request inside the continuous-batching engine (:mod:`writescope.engine.runner`): its
prompt, sampling parameters, place in the KV cache and the tokens generated so far."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from writescope.engine.logprobs import TokenLogprobs
from writescope.engine.sampling import SamplingParams
from writescope.engine.stop_strings import StopStrings

WAITING, PREFILLING, RUNNING, FINISHED = "waiting", "prefilling", "running", "finished"


@dataclass(eq=False)
class Request:
    """A request's state, owned by the engine thread (never read or written from another).

    Attributes:
        request_id: unique among the engine's requests.
        prompt_ids: prompt token ids (at least one).
        params: its sampling parameters (``max_tokens``, stop conditions, temperature...).
        arrival: ``time.perf_counter()`` when it was submitted (TTFT is measured from here).
        status: ``waiting`` (queued, no KV), ``prefilling`` (holds a slot, prompt partly
            cached), ``running`` (decoding), ``finished``.
        slot: its KV cache slot once admitted, None before and after.
        num_prefilled: prompt tokens already in the cache (tokens).
        output_ids: generated token ids.
        finish_reason: ``stop`` (end or stop token, or a stop string), ``length`` (max_tokens), ``abort``
            (cancelled), ``error`` (failed inside the engine; ``error`` says why).
        generator: its sampling generator (None for greedy requests).
        first_token_at, last_token_at: ``time.perf_counter()`` of its first and last token
            (TTFT, inter-token latency).
        kv_placement: tokens of its KV per region (``window``, ``compute``, ``load``) when its
            slot was freed, under a partitioned policy; else None.
        stops: its decoded text checked for ``params.stop`` (None without stop strings: then
            nothing is decoded in the engine).
        logprobs: one :class:`TokenLogprobs` per output token when ``params.logprobs`` asks
            (None otherwise).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    status: str = WAITING
    slot: int | None = None
    num_prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    kv_placement: dict[str, int] | None = None
    pending_ttft: float | None = None  # latencies not yet handed out in a StepOutput
    pending_itl: list[float] = field(default_factory=list)
    stops: StopStrings | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def capacity(self) -> int:
        """KV tokens it may reach: prompt + max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def stop_reason(self) -> str | int | None:
        """Once finished with ``stop``: the stop string that ended its text, or its last token if
        that is one of ``params.stop_token_ids``; None otherwise (an end token, a length limit,
        not finished). vLLM's ``stop_reason``."""
        if self.finish_reason != "stop":
            return None
        if self.stops is not None and self.stops.stopped:
            return self.stops.matched
        last = self.output_ids[-1] if self.output_ids else None
        return last if last in self.params.stop_token_ids else None

    @property
    def context_len(self) -> int:
        """Tokens in its cache before its next decode step: prompt + generated - 1 (the last
        generated token is the next step's input)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request (handed to other threads: plain values).

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated in this step (0, 1 or 2: a prefill's first token and
            its first decode step can fall in one step).
        finish_reason: set on the request's last output (see :class:`Request`).
        error: why it failed (``finish_reason == "error"``), or why its KV could not be freed.
        prompt_tokens, output_tokens: the request's totals so far (tokens).
        ttft_s: seconds from arrival to the first token, on the output that carries it.
        itl_s: seconds between each of this output's later tokens and the token before it.
        text: for a request with stop strings, the text this output adds (held back while a stop
            string may still claim it; the pieces concatenate to the final text, which ends
            before the stop string); None without stop strings (decode ``new_token_ids``).
        logprobs: with ``params.logprobs``, one :class:`TokenLogprobs` per new token; else None.
        stop_reason: on the last output, :attr:`Request.stop_reason` (the stop string or stop
            token id that ended it, or None).
    """

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    text: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
