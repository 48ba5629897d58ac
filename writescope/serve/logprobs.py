"""Logprobs in the two OpenAI shapes, from the engine's
:class:`~writescope.engine.logprobs.TokenLogprobs` (log_softmax of the raw logits, before
temperature: vLLM's default).

Completions (the legacy API, ``"logprobs": k``)::

    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}], "text_offset": [int]}

``top_logprobs[i]`` holds the k most likely tokens, most likely first, and the sampled token when
it is not among them (last: it is less likely than all of them), so up to k + 1 entries as the
API documents (fewer when two of them decode to the same text: a dict keeps the likelier). ``text_offset[i]`` is where token i's text starts in the choice's text, counting
each token's own text (vLLM's offsets; the text may end earlier, at a stop string).

Chat (``"logprobs": true, "top_logprobs": k``)::

    {"content": [{"token": str, "logprob": float, "bytes": [int], "top_logprobs": [{"token", "logprob", "bytes"}]}]}

with the k most likely tokens, most likely first. A token's text is its id decoded alone (a
piece of a multi-byte character decodes to U+FFFD), its ``bytes`` that text's UTF-8, as vLLM
gives them. Logprobs below -9999 (or -inf) are sent as -9999.0, as OpenAI and vLLM do (JSON has
no infinity).
"""

from __future__ import annotations

from writescope.engine.logprobs import TokenLogprobs

FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, FLOOR)


class LogprobFormatter:
    """Formats logprobs with ``tokenizer`` (token texts are cached per id)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._texts: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        t = self._texts.get(token_id)
        if t is None:
            t = self._texts[token_id] = self.tok.decode([token_id])
        return t

    def completion(self, lps: list[TokenLogprobs], offset: int = 0) -> tuple[dict, int]:
        """The completions shape of ``lps``, their text offsets starting at ``offset``; returns it
        and the offset after the last token (where a later chunk's tokens start)."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for lp in lps:
            text = self.token(lp.token_id)
            top: dict[str, float] = {}
            for i, v in lp.top:  # two ids of one text (pieces of characters): the likelier one's
                top.setdefault(self.token(i), _lp(v))
            if all(i != lp.token_id for i, _ in lp.top):
                top.setdefault(text, _lp(lp.logprob))
            tokens.append(text)
            token_logprobs.append(_lp(lp.logprob))
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}, offset

    def chat(self, lps: list[TokenLogprobs]) -> dict:
        """The chat shape of ``lps``."""
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(i, v) for i, v in lp.top]} for lp in lps]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}
