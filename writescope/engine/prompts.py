"""What ``LLM.generate`` accepts as prompts, normalised to token-id lists and checked against the
vocabulary (errors name the argument the prompts came through)."""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

from writescope.errors import ArgError, plural


def token_lists(prompts: Any, prompt_token_ids: Any, encode: Callable[[str], list[int]]
                ) -> tuple[list[str | None], list[list[int]], str]:
    """(texts, token ids, argument name) of one batch.

    ``prompts``: a string, or a list whose items are strings, token-id lists (as vLLM's
    ``prompt_token_ids``) or dicts ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` (vLLM's
    TextPrompt and TokensPrompt); ``prompt_token_ids``: a list of token-id lists. Texts are
    None for prompts given as ids.

    Raises:
        ArgError: both or neither given, an empty batch, a flat list of ints (one prompt is
            ``[[1, 2, 3]]``), or an item that is neither text nor integer ids (named by index).
    """
    if prompt_token_ids is not None:
        if prompts is not None:
            raise ArgError("pass either prompts or prompt_token_ids, not both", "prompts", "prompt_token_ids")
        name, items = "prompt_token_ids", prompt_token_ids
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or len(items) == 0:
            raise ArgError("prompt_token_ids must be a non-empty list of token-id lists, e.g. [[1, 2, 3]]", name)
    else:
        name, items = "prompts", [prompts] if isinstance(prompts, (str, dict)) else prompts
        if items is None or not isinstance(items, Sequence) or len(items) == 0:
            raise ArgError("no prompts given: pass a list of strings or token-id lists, or prompt_token_ids", name)
    if all(_is_int(t) for t in items):
        raise ArgError(f"{name} is a flat list of integers: pass a list of prompts, e.g. [[1, 2, 3]] for one prompt of token ids",
                       name)
    texts: list[str | None] = []
    ids: list[list[int]] = []
    for i, p in enumerate(items):
        if isinstance(p, dict) and name == "prompts":
            if set(p) not in ({"prompt"}, {"prompt_token_ids"}):
                raise ArgError(f"prompts[{i}] is a dict with keys {sorted(p)}: give exactly 'prompt' or 'prompt_token_ids'", name)
            p = p.get("prompt", p.get("prompt_token_ids"))
        if isinstance(p, str) and name == "prompts":
            texts.append(p)
            ids.append(encode(p))
            continue
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            what = "a string or a list of token ids" if name == "prompts" else "a list of token ids"
            raise ArgError(f"{name}[{i}] is {type(p).__name__} {p!r:.40}: give {what}", name)
        row = []
        for j, t in enumerate(p):
            if not _is_int(t):
                raise ArgError(f"{name}[{i}][{j}] is {t!r:.40}, not a token id (an integer)", name)
            row.append(operator.index(t))
        texts.append(None)
        ids.append(row)
    return texts, ids, name


def check_token_ids(ids: Sequence[Sequence[int]], vocab_size: int, name: str) -> None:
    """Every id in [0, vocab_size); ``name`` is the argument (or flag) the ids came through.

    Raises:
        ArgError: the first id outside the vocabulary, with its request, position and the vocab size.
    """
    for i, row in enumerate(ids):
        for j, t in enumerate(row):
            if not 0 <= t < vocab_size:
                raise ArgError(f"{name}[{i}] has token id {t} at position {j}, outside the model's vocabulary of "
                               f"{vocab_size:,} ids [0, {vocab_size}): use ids below {vocab_size}", name)


def _is_int(t: Any) -> bool:
    if isinstance(t, bool):
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


class TooLong(ArgError):
    """Request ``index`` of ``name`` (``"prompts"`` or ``"prompt_token_ids"``), a prompt of
    ``tokens`` tokens plus ``max_tokens`` to generate, passes ``limit`` tokens: the engine's
    max_model_len, at most ``model_limit`` (the model's max_position_embeddings).

    The fields are public for callers that word the advice for their own flags (bench does); the
    message (``str(e)``) is :attr:`problem`, then each change that alone makes the request fit.
    """

    def __init__(self, name: str, index: int, tokens: int, max_tokens: int, limit: int, model_limit: int,
                 prompt_flag: str | None = None):
        self.name, self.index, self.tokens, self.max_tokens = name, index, tokens, max_tokens
        self.limit, self.model_limit = limit, model_limit
        ways = []  # each change that alone makes the request fit
        if self.prompt_fits is not None and prompt_flag is not None:  # a command's flag that sets the prompt's length
            ways.append(f"use {prompt_flag} {self.prompt_fits} or less")
        elif self.prompt_fits is not None:
            ways.append(f"shorten the prompt to at most {plural(self.prompt_fits, 'token')}")
        if self.max_tokens_fits is not None:
            ways.append(f"lower max_tokens to at most {self.max_tokens_fits:,}")
        if self.can_raise:
            ways.append("raise max_model_len")
        if not ways:
            ways.append("shorten the prompt and lower max_tokens")
        super().__init__(f"{self.problem}: " + ", or ".join(ways), name, "max_tokens", "max_model_len")

    @property
    def source(self) -> str:
        """Where ``limit`` comes from: ``"max_model_len"`` below the model's own, else the model's."""
        return "max_model_len" if self.limit < self.model_limit else "the model's max_position_embeddings"

    @property
    def prompt_fits(self) -> int | None:
        """The longest prompt (tokens) that fits with this ``max_tokens``; None where none does."""
        return self.limit - self.max_tokens if self.limit > self.max_tokens else None

    @property
    def max_tokens_fits(self) -> int | None:
        """The largest ``max_tokens`` that fits with this prompt; None where none does."""
        return self.limit - self.tokens if self.limit > self.tokens else None

    @property
    def can_raise(self) -> bool:
        """Whether raising max_model_len (up to ``model_limit``) is a way out."""
        return self.limit < self.model_limit

    @property
    def problem(self) -> str:
        """The message without its advice: the request, its sum and the limit with its source."""
        return (f"{self.name}[{self.index}] has {plural(self.tokens, 'token')} + max_tokens {self.max_tokens:,} = "
                f"{self.tokens + self.max_tokens:,}, beyond the limit of {plural(self.limit, 'token')} ({self.source})")


def too_long(name: str, i: int, tokens: int, max_tokens: int, limit: int, model_limit: int,
             prompt_flag: str | None = None) -> TooLong:
    """The error (an :class:`ArgError`) for request ``i`` of ``name`` whose ``tokens`` + ``max_tokens``
    pass ``limit`` (the engine's max_model_len; ``model_limit``: the model's own, named when it is higher);
    ``prompt_flag``: a command's flag that sets the prompt's length in tokens (generate's
    ``--machine-text``), named in the advice instead of "shorten the prompt"."""
    return TooLong(name, i, tokens, max_tokens, limit, model_limit, prompt_flag)


def check_max_model_len(max_model_len: int | None, limit: int) -> None:
    """``max_model_len`` (None: the model's limit) within ``[1, limit]``, the model's
    ``max_position_embeddings``.

    Raises:
        ArgError: outside that range (names ``max_model_len``).
    """
    if max_model_len is not None and not 1 <= max_model_len <= limit:
        raise ArgError(f"max_model_len {max_model_len} must be in [1, {limit}] (the model's max_position_embeddings)", "max_model_len")
