"""The choices of a response: each choice's output accumulated as its engine request's
:class:`~writescope.engine.request.StepOutput`\\ s arrive (:class:`Choice`), and the OpenAI JSON
shapes built from them (:class:`ResponseFormat`): a whole response, or server-sent-event chunks.

A choice's text: for a request with stop strings the engine decodes it and hands out pieces that
no stop string can still claim (``StepOutput.text``: the concatenation ends before the stop
string); otherwise it is decoded here (streamed: :class:`~writescope.serve.detokenizer.Detokenizer`
deltas; whole: ``tokenizer.decode`` of its tokens).

Each choice carries vLLM's ``stop_reason`` beside OpenAI's ``finish_reason``: the stop string or
the ``stop_token_ids`` token that ended it, else null (streamed: on its finishing chunk only).

Streamed, a choice's finishing chunk carries its last outputs' delta (text, ``token_ids``,
logprobs) with ``finish_reason``, as vLLM's: the token that completes a stop string may add no
text (the stop string is cut, and the text before it was handed out already), and no chunk of
empty text goes out before the finish for it. Chunks before the finish carry text, or tokens when
the client reads them (``return_token_ids``, ``logprobs``): a token whose text is held back (a stop
string's possible start, an incomplete UTF-8 character) sends nothing otherwise.

Usage: the prompt's tokens once, the completion tokens summed over the choices (each choice's
tokens as generated, the ones that completed a stop string included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from writescope.engine.logprobs import TokenLogprobs
from writescope.engine.request import StepOutput
from writescope.serve.detokenizer import Detokenizer
from writescope.serve.logprobs import LogprobFormatter


@dataclass(frozen=True)
class Delta:
    """What some outputs of one choice added: text, token ids, their logprobs."""

    text: str
    ids: list[int]
    logprobs: list[TokenLogprobs]


class Choice:
    """One choice's output so far.

    Args:
        index: its index among the response's choices.
        tokenizer: decodes its tokens.
        streaming: decode incrementally as tokens come (else only at the end, :meth:`text`).
    """

    def __init__(self, index: int, tokenizer, streaming: bool):
        self.index = index
        self.tok = tokenizer
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.last: StepOutput | None = None  # its finishing output
        self.ttft_s: float | None = None  # the engine's time to its first token (from the request's arrival)
        self._engine_text: list[str] | None = None  # the engine's pieces (stop strings)
        self._detok = Detokenizer(tokenizer) if streaming else None
        self.text_offset = 0  # where the next streamed token's text starts (completions logprobs)

    @property
    def finished(self) -> bool:
        return self.last is not None

    def add(self, outs: list[StepOutput]) -> Delta:
        """Take this choice's next outputs (in order); returns what they add (text only when
        streaming, or from the engine)."""
        ids = [t for o in outs for t in o.new_token_ids]
        lps = [lp for o in outs for lp in (o.logprobs or ())]
        self.ids += ids
        self.logprobs += lps
        if self.ttft_s is None:
            self.ttft_s = next((o.ttft_s for o in outs if o.ttft_s is not None), None)
        if outs[-1].finished:
            self.last = outs[-1]
        if outs[0].text is not None:
            text = "".join(o.text or "" for o in outs)
            self._engine_text = (self._engine_text or []) + [text]
        elif self._detok is not None:
            text = self._detok.add(ids) + (self._detok.flush() if self.finished else "")
        else:
            text = ""
        return Delta(text, ids, lps)

    def text(self) -> str:
        """The whole text (once finished)."""
        return "".join(self._engine_text) if self._engine_text is not None else self.tok.decode(self.ids)


def usage(choices: list[Choice]) -> dict:
    prompt = choices[0].last.prompt_tokens
    completion = sum(c.last.output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(msg: dict) -> str:
    return f"data: {json.dumps(msg, ensure_ascii=False)}\n\n"


class ResponseFormat:
    """The JSON of one response (``chat``: chat.completion, else text_completion).

    Args:
        chat: the chat shapes (``message``/``delta``; chat logprobs) or the completions ones.
        rid, created, model: the response's ``id``, ``created`` and ``model``.
        tokenizer: decodes logprobs' tokens.
        return_token_ids: each choice (and chunk) also carries its ``token_ids`` (vLLM's extension).
        logprobs: the request asked for logprobs (each choice and chunk carries its tokens').
        echo: completions' ``echo``: the prompt's text, put before each choice's
            (:mod:`writescope.serve.echo`); None: no echo.
    """

    def __init__(self, chat: bool, rid: str, created: int, model: str, tokenizer, return_token_ids: bool, logprobs: bool,
                 echo: str | None = None):
        self.chat, self.rid, self.created, self.model = chat, rid, created, model
        self.return_token_ids, self.want_logprobs, self.echo = return_token_ids, logprobs, echo
        self.lp = LogprobFormatter(tokenizer)

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, c: Choice, lps: list[TokenLogprobs], streamed: bool) -> dict | None:
        if not self.want_logprobs or (streamed and not lps):
            return None
        if self.chat:
            return self.lp.chat(lps)
        out, end = self.lp.completion(lps, c.text_offset if streamed else 0)
        if streamed:
            c.text_offset = end
        return out

    # ------------------------------------------------------------ whole
    def response(self, choices: list[Choice]) -> dict:
        """The non-streamed response of finished ``choices``."""
        body = []
        for c in choices:
            d = {"index": c.index, "finish_reason": c.last.finish_reason, "stop_reason": c.last.stop_reason,
                 "logprobs": self._logprobs(c, c.logprobs, False)}
            if self.chat:
                d["message"] = {"role": "assistant", "content": c.text()}
            else:
                d["text"] = (self.echo or "") + c.text()
            if self.return_token_ids:
                d["token_ids"] = c.ids
            body.append(d)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": body,
                "usage": usage(choices)}

    # ------------------------------------------------------------ streamed
    def opening(self, choices: list[Choice]) -> list[str]:
        """The events before any choice's tokens: chat's role, or the echoed prompt, one per choice."""
        if self.chat:
            return [self.chunk(c, role=True) for c in choices]
        if self.echo is not None:
            return [self.chunk(c, Delta(self.echo, [], [])) for c in choices]
        return []

    def chunk(self, c: Choice, delta: Delta | None = None, finish: str | None = None, role: bool = False) -> str:
        """One SSE event for choice ``c``: the role (chat's first), a delta, or its finish with
        its last delta (``finish``: its finish_reason)."""
        lps = self._logprobs(c, delta.logprobs, True) if delta is not None else None
        stop_reason = c.last.stop_reason if finish is not None else None
        if self.chat:
            if role:
                d = {"role": "assistant", "content": ""}
            else:  # a finishing chunk without text has an empty delta (OpenAI's)
                d = {"content": delta.text} if delta is not None and (delta.text or finish is None) else {}
            choice = {"index": c.index, "delta": d, "logprobs": lps, "finish_reason": finish, "stop_reason": stop_reason}
        else:
            choice = {"index": c.index, "text": delta.text if delta is not None else "", "logprobs": lps, "finish_reason": finish,
                      "stop_reason": stop_reason}
        if self.return_token_ids and not role:
            choice["token_ids"] = list(delta.ids) if delta is not None else []
        return sse({**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]})

    def usage_chunk(self, usage: dict) -> str:
        """``stream_options.include_usage``'s last event: no choices, the response's usage."""
        return sse({**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                    "usage": usage})

    def worth_sending(self, delta: Delta) -> bool:
        """A delta before a choice's finish goes out when it has text, or tokens a client reads
        (their ids or logprobs). (The finishing delta goes with finish_reason, whatever it holds.)"""
        return bool(delta.text or (delta.ids and (self.return_token_ids or self.want_logprobs)))
