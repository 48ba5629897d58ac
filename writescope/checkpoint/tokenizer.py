"""Tokenizers: a checkpoint's ``tokenizer.json``, or a byte-level BPE trained here.

The synthetic tokenizer is trained with the ``tokenizers`` library on the Python standard
library's own sources, read at run time from this interpreter's installation (the repository
carries no corpus), and cached under ``$XDG_CACHE_HOME/writescope/tokenizers`` (default
``~/.cache``). Its special tokens ``<unk> <s> </s>`` take ids 0, 1, 2.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from writescope.paths import cache_dir

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


class Tokenizer:
    """Text <-> token ids. Ids the tokenizer does not know (a model vocabulary padded past the
    tokenizer's, as synthetic checkpoints have) decode to nothing."""

    def __init__(self, tok: HFTokenizer):
        self._tok = tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: the same ids, but it lets go of the GIL while it works (seconds for a
        # prompt of millions of characters), so the server's event loop answers meanwhile (it encodes off the loop)
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    @staticmethod
    def from_file(path: str | Path) -> "Tokenizer":
        try:
            return Tokenizer(HFTokenizer.from_file(str(path)))
        except Exception as e:
            raise ValueError(f"cannot read tokenizer {path}: {e}") from e


def stdlib_sources() -> list[Path]:
    """This interpreter's standard-library sources, tests and site-packages left out, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def _cache_dir() -> Path:
    return cache_dir("tokenizers")


def synthetic_tokenizer(vocab_size: int, use_cache: bool = True) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens (fewer when the corpus runs out of
    merges: about 120K from CPython 3.11's sources). Takes 1-10 s the first time, then cached.

    Raises:
        ValueError: vocab_size < 259 (256 bytes + 3 special tokens).
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (needs >= 259)")
    tag = hashlib.sha1(f"{sys.version_info[:2]}-{vocab_size}".encode()).hexdigest()[:12]
    path = _cache_dir() / f"bpe-{vocab_size}-{tag}.json"
    if use_cache and path.is_file():
        return Tokenizer.from_file(path)
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((p.read_text(errors="replace") for p in stdlib_sources()), trainer)
    result = Tokenizer(tok)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        result.save(tmp)
        os.replace(tmp, path)
    return result
