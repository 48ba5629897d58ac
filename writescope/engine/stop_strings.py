"""Stop strings (``SamplingParams.stop``): a request's output is decoded as its tokens come and
ends at the first stop string it contains; its text ends before that string (with
``SamplingParams.include_stop_str_in_output``: after it, so the string stays in the text; text
that came after it in the same token is cut either way).

The check follows vLLM's: after each token only the new text and the ``len(stop) - 1``
characters before it are searched (the text before that was searched already), so a stop
string split over several tokens is found when its last character arrives. Where two stop
strings complete on one token, the text ends at the earlier one. The tokens stay as generated:
the one that completed the stop string is counted (usage) though its text is cut.

Streaming: :meth:`StopStrings.take` hands out text that no stop string can still claim, holding
back the last ``len(longest stop) - 1`` characters until the next token shows they are not the
start of one (or the request ends). So a client never sees text that later turns out to be part
of a stop string, and the pieces concatenate to the final text. With the stop string kept in the
text nothing is held back: text already seen can only be followed by a stop string, not cut.
"""

from __future__ import annotations

from typing import Callable

from writescope.engine.streaming import IncrementalDetokenizer


class StopStrings:
    """One request's incrementally decoded text and its stop strings.

    Args:
        decode: ``ids -> text`` (the engine's ``tokenizer.decode``).
        stop: the stop strings (non-empty, checked by ``SamplingParams``).
        include: keep the stop string in the text (``include_stop_str_in_output``).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...], include: bool = False):
        self.detok = IncrementalDetokenizer(decode)
        self.stop = stop
        self.include = include
        self.hold = 0 if include else max(map(len, stop)) - 1  # characters a stop string may still claim
        self.cut: int | None = None  # where the text ends (the first stop string's start, or end with include) once found
        self.matched: str | None = None  # that stop string
        self.emitted = 0  # characters handed out by take()

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    def push(self, token_id: int) -> bool:
        """Add a generated token; True once the text contains a stop string."""
        if self.cut is not None:
            return True
        piece = self.detok.push(token_id)
        if piece:
            text, found = self.detok.text, None
            for s in self.stop:
                i = text.find(s, max(0, len(text) - len(piece) - len(s) + 1))
                if i >= 0 and (found is None or i < found[0]):
                    found = (i, s)
            if found is not None:
                self.cut, self.matched = found[0] + (len(found[1]) if self.include else 0), found[1]
        return self.cut is not None

    def take(self, final: bool) -> str:
        """The text not handed out yet that no stop string can still claim; with ``final`` (the
        request is over) all the rest: up to the stop string (or its end, with ``include``), or
        the whole decoded text."""
        if self.cut is not None:
            end = self.cut
        elif final:
            self.detok.finish()
            end = len(self.detok.text)
        else:
            end = len(self.detok.text) - self.hold
        if end <= self.emitted:
            return ""
        piece = self.detok.text[self.emitted : end]
        self.emitted = end
        return piece

    @property
    def text(self) -> str:
        """The output text once the request is over (after ``take(final=True)``)."""
        return self.detok.text[: self.emitted]
