"""``echo`` for ``/v1/completions`` (OpenAI's semantics): each choice's text is the prompt's text
followed by its completion; streamed, the prompt's text comes first, as each choice's own chunk
(:meth:`~writescope.serve.choices.ResponseFormat.opening`). The prompt's text is the prompt as
sent, or its token ids decoded. Usage, ``token_ids`` and stop strings are the completion's alone.

With ``max_tokens: 0`` there is nothing to generate: the answer (the prompt, finish_reason
``length``, 0 completion tokens) is made here, without an engine request (:func:`prompt_only`),
the prompt checked as any request's. ``echo`` with ``logprobs`` is refused (the protocol): OpenAI
would return the prompt tokens' logprobs too, and the engine's prefill computes logits for each
prompt's last token only.
"""

from __future__ import annotations

import asyncio

from writescope.engine.request import StepOutput
from writescope.serve.async_engine import AsyncEngine, RequestStream


def prompt_text(prompt: str | list[int], ids: list[int], tokenizer) -> str:
    """What ``echo`` puts before each completion: the prompt as sent, or ``ids`` decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


def prompt_only(engine: AsyncEngine, ids: list[int], n: int, checked: bool = False) -> RequestStream:
    """The stream of ``n`` choices that generate nothing (``echo`` with ``max_tokens`` 0), every
    choice finished already; call on the event loop. Nothing is queued in the engine.
    ``checked``: ``engine.core.check(ids, 0)`` passed already (off the loop: not done again).

    Raises:
        ArgError: a prompt no request could take (see
            :meth:`~writescope.engine.runner.EngineCore.check`).
    """
    if not checked:
        engine.core.check(ids, 0)
    stream = RequestStream([f"echo-{i}" for i in range(n)], asyncio.get_running_loop())
    for i, rid in enumerate(stream.request_ids):
        stream.queue.put_nowait((i, StepOutput(rid, finish_reason="length", prompt_tokens=len(ids))))
    return stream
