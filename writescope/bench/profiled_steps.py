"""Decode steps run for a profiler: what :mod:`~writescope.bench.breakdown`,
:mod:`~writescope.bench.timeline` and :mod:`~writescope.bench.host_profile` share.

Each generates ``2 + skip + steps`` tokens of every prompt (EOS ignored) with a hook after every
decode step (the first of which holds the prefill) and, where asked, one as the main thread
enters each decode layer's attention. Meanwhile the work outside attention (O) and the in-step A
are not measured (:meth:`~writescope.scheduler.other_work.OtherWork.paused`): profiled steps are
slower than real ones, and measured they would place later requests' KV.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

from writescope.engine.sampling import SamplingParams


def check_steps(steps: int, skip: int) -> None:
    """Raises ValueError unless ``steps >= 1`` and ``skip >= 0`` (names both)."""
    if steps < 1 or skip < 0:
        raise ValueError(f"steps must be >= 1 and skip >= 0, got {steps}, {skip}")


def run_decode_steps(llm, prompt_token_ids: list[list[int]], steps: int, skip: int, on_step: Callable[[], None],
                     on_attention: Callable[[], None] | None = None, around=None) -> None:
    """Generate with the prompts for ``1 + skip + steps`` decode steps, calling ``on_step()`` after
    each (the engine's step hook) and ``on_attention()`` as the main thread enters each decode
    layer's attention (every query length 1; a wrapper over the cache's ``attend_begin``, removed
    after), inside the context manager ``around`` (a profiler, say) when given.

    Raises:
        ValueError: steps < 1 or skip < 0; and whatever ``generate`` raises for the prompts.
    """
    check_steps(steps, skip)
    cache = llm.cache
    if on_attention is not None:
        inner = cache.attend_begin

        def begin(layer_id, q, k, v, batch, *args, **kwargs):
            if all(n == 1 for n in batch.query_lens):
                on_attention()
            return inner(layer_id, q, k, v, batch, *args, **kwargs)

        cache.attend_begin = begin  # an instance attribute over the method, removed below
    llm.step_hook = on_step
    meter = getattr(llm, "other_work", None)
    try:
        with around if around is not None else nullcontext(), meter.paused() if meter is not None else nullcontext():
            llm.generate(prompt_token_ids=prompt_token_ids, sampling_params=SamplingParams(max_tokens=2 + skip + steps, ignore_eos=True))
    finally:
        llm.step_hook = None
        if on_attention is not None:
            del cache.attend_begin
