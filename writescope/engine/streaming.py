"""Tokens as they are produced: the per-step events of ``LLM.generate(on_tokens=...)``, the
incremental detokenizer that turns a request's growing token list into printable text, and the
two consumers ``writescope generate`` uses (a single request's text streamed to a file, a batch's
progress bar with tok/s).

Incremental decoding follows vLLM's ``detokenize_incrementally`` (and the idea of llama.cpp's CLI
and transformers' ``TextStreamer``): decode the ids from a short way back (``prefix_offset``) to
the newest one, compare with the decode of the same prefix without the new ids, and print the
difference. A token that ends inside a multi-byte UTF-8 character decodes to U+FFFD: nothing is
printed until the ids that complete it arrive, so a character split over tokens comes out whole.
Decoding from a few tokens back (not from the start) keeps a step O(1) in the text's length and
gives decoders that strip the first token's leading space (SentencePiece) the same prefix on both
sides. For byte-level BPE (Qwen3, DeepSeek, Llama 3 and the synthetic tokenizer) the printed
pieces concatenate to ``tokenizer.decode(all ids)`` exactly; :meth:`IncrementalDetokenizer.finish`
prints whatever the final decode has beyond them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, TextIO

from tqdm import tqdm

REPLACEMENT = "\ufffd"  # what a decoder yields for the bytes of an unfinished UTF-8 character


@dataclass(frozen=True)
class TokenEvent:
    """One token of one request, as ``LLM.generate`` produces it.

    Attributes:
        index: the request's position in the batch (the order of the prompts).
        token_id: the new token.
        finish_reason: ``"stop"`` or ``"length"`` when this token ends the request's choice, else None.
        choice: which of the prompt's ``SamplingParams.n`` choices it belongs to (0 with n = 1).
    """

    index: int
    token_id: int
    finish_reason: str | None
    choice: int = 0


#: ``LLM.generate(on_tokens=...)``: called after the prefill (the first token of every request) and
#: after every decode step (one event per request still running), in batch order
OnTokens = Callable[[list[TokenEvent]], None]


class IncrementalDetokenizer:
    """A request's output token ids in, its text out piece by piece (see the module docstring).

    Args:
        decode: ``ids -> text`` (e.g. ``Tokenizer.decode``).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""  # everything returned so far
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already returned
        self._read_offset = 0  # ids before it are in self.text

    def push(self, token_id: int) -> str:
        """Add one token; returns the new text it completes ("" while a character is unfinished)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""  # nothing new yet, or the last bytes are half a character: wait for the rest
        piece = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += piece
        return piece

    def finish(self) -> str:
        """The rest of the text once the request is over: what ``decode(all ids)`` has beyond the
        pieces returned (an unfinished character at the very end comes out as U+FFFD here, as it
        does in the final text)."""
        final = self._decode(self.ids)
        rest = final[len(self.text):] if final.startswith(self.text) else ""
        self.text += rest
        return rest


class TextStreamer:
    """``on_tokens`` for one request: prints its text to ``file`` (default: ``sys.stdout`` at the
    time of printing) as it is decoded, flushed piece by piece.

    Args:
        decode: ``ids -> text`` (the engine's ``tokenizer.decode``).
        file: where to print; None: ``sys.stdout``.
        header: a line printed before the first token's text (not at all if generate fails first).
    """

    def __init__(self, decode: Callable[[list[int]], str], file: TextIO | None = None, header: str | None = None):
        self.detok = IncrementalDetokenizer(decode)
        self.file = file
        self.header = header

    def _write(self, text: str) -> None:
        if text:
            out = self.file or sys.stdout
            out.write(text)
            out.flush()

    def __call__(self, events: list[TokenEvent]) -> None:
        if self.header is not None:
            self._write(self.header + "\n")
            self.header = None
        for e in events:
            if e.index != 0 or e.choice != 0:
                raise ValueError(f"TextStreamer streams one request of one choice, got an event for request {e.index}, "
                                 f"choice {e.choice}: use BatchProgress for a batch")
            self._write(self.detok.push(e.token_id))
            if e.finish_reason is not None:
                self._write(self.detok.finish())


class BatchProgress:
    """``on_tokens`` for a batch of one choice per prompt (``SamplingParams.n`` = 1, as the CLI
    runs): a tqdm bar of the tokens generated, with tok/s (from the first token on) and the
    requests finished (as vLLM's ``LLM.generate`` shows), on stderr.

    Args:
        max_tokens: each request's ``max_tokens`` (the bar's total; a request that stops early
            takes its unused tokens off the total).
        disable: no bar (``--quiet``).
    """

    def __init__(self, max_tokens: list[int], disable: bool = False):
        self.max_tokens = list(max_tokens)
        self.produced = [0] * len(max_tokens)
        self.finished = 0
        self.disable = disable
        self.bar: tqdm | None = None  # made at the first tokens: after the prefill's own bar, and tok/s is the decode's

    def __call__(self, events: list[TokenEvent]) -> None:
        if self.bar is None:
            self.bar = tqdm(total=sum(self.max_tokens), desc="generate", unit="tok", disable=self.disable, dynamic_ncols=True)
        for e in events:
            self.produced[e.index] += 1
            if e.finish_reason is not None:
                self.finished += 1
                self.bar.total -= self.max_tokens[e.index] - self.produced[e.index]
        self.bar.set_postfix_str(f"requests done {self.finished}/{len(self.max_tokens)}", refresh=False)
        self.bar.update(len(events))
        if self.finished == len(self.max_tokens):
            self.bar.close()

    def close(self) -> None:
        """Close the bar (also when generate raised before the last token)."""
        if self.bar is not None:
            self.bar.close()
