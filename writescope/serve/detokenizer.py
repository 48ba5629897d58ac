"""Incremental detokenization for streaming: text deltas that never split a multi-byte character.
(A request with stop strings is decoded in the engine instead, which cuts its text at the stop
string: :mod:`writescope.engine.stop_strings`.)"""

from __future__ import annotations


class Detokenizer:
    """Turns tokens, as they come, into text deltas whose concatenation is the decoded text.

    Decodes a short window of the newest tokens each time (not the whole output), and holds back
    text that ends in an incomplete UTF-8 sequence (decoded as U+FFFD) until the next token
    completes it.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the window decoded for context
        self.read = 0  # tokens whose text was handed out

    def add(self, new_ids) -> str:
        """The text the new tokens add ("" while a character is incomplete)."""
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """What is held back (at the end of the output), even if incomplete."""
        before = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]
