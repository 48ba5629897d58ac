"""``SamplingParams.n``: the n choices of one prompt, each its own engine request.

Choice i of a prompt samples with ``seed + i`` when its params give a ``seed`` (choice 0 is the
request itself, and choice i generates what a single-choice request seeded ``seed + i`` does);
without a seed each choice takes its own engine seed (the engine's seed + its number among the
engine's requests, as any request does). Greedy choices are equal. Every choice prefills the
prompt itself (no KV is shared) and takes its own cache slot.

Both ``LLM.generate`` (:func:`expand_batch`, then :func:`group` of its outputs) and the server's
``n`` (:class:`~writescope.serve.async_engine.AsyncEngine`, :func:`expand`) expand here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence, TypeVar

from writescope.engine.sampling import SamplingParams

T = TypeVar("T")


def expand(params: SamplingParams) -> list[SamplingParams]:
    """The ``params.n`` single-choice parameters of one prompt (``n == 1`` each), choice i seeded
    ``params.seed + i`` when ``params.seed`` is given."""
    one = params if params.n == 1 else replace(params, n=1)
    return [one if one.seed is None or i == 0 else replace(one, seed=one.seed + i) for i in range(params.n)]


def expand_batch(params: Sequence[SamplingParams]) -> list[tuple[int, int, SamplingParams]]:
    """``(prompt index, choice index, single-choice params)`` of every choice of a batch whose
    prompt i has ``params[i]``: prompt by prompt, each prompt's choices in order."""
    return [(i, c, p) for i, sp in enumerate(params) for c, p in enumerate(expand(sp))]


def group(flat: Sequence[tuple[int, int, SamplingParams]], items: Sequence[T]) -> list[list[T]]:
    """``items`` (one per entry of ``flat``, from :func:`expand_batch`) as one list per prompt,
    each in choice order."""
    out: list[list[T]] = [[] for _ in range(max((i for i, _, _ in flat), default=-1) + 1)]
    for (i, _, _), item in zip(flat, items):
        out[i].append(item)
    return out
