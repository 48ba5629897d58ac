"""Real text from this machine for long prompts: the Python installation's license and the module
docstrings of its standard library, read at run time (the repository carries no corpus)."""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

from writescope.checkpoint.tokenizer import stdlib_sources

REQUEST_SHIFT = 997  # tokens between the starts of consecutive requests' prompts


def machine_text_files() -> list[Path]:
    """``LICENSE.txt`` of the standard library, then its modules: the synthetic tokenizer's
    corpus (tests and site-packages left out), sorted."""
    lic = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    return ([lic] if lic.is_file() else []) + stdlib_sources()


def machine_text(min_chars: int) -> str:
    """At least ``min_chars`` characters of prose (the license text, then module docstrings, each
    headed by its module path), or all there is.

    Raises:
        ValueError: this installation has no readable text at all.
    """
    parts, total = [], 0
    for p in machine_text_files():
        try:
            src = p.read_text(errors="replace")
            text = src if p.suffix == ".txt" else ast.get_docstring(ast.parse(src))
        except (OSError, SyntaxError, ValueError):
            continue
        if text:
            parts.append(f"# {p.name}\n\n{text.strip()}\n")
            total += len(parts[-1])
            if total >= min_chars:
                break
    if not parts:
        raise ValueError("no text found in this Python installation's standard library: give --prompt-file")
    return "\n".join(parts)


def machine_prompts(tokenizer, tokens: int, batch: int) -> tuple[list[list[int]], int]:
    """``batch`` prompts of exactly ``tokens`` token ids each; request i starts ``i * REQUEST_SHIFT``
    tokens into the text, so the requests differ. Where the text runs out it starts again from
    the beginning (CPython 3.11's gives about 67K tokens with a 151K-token vocabulary).

    Returns:
        ``(prompts, tokens the text holds)``.

    Raises:
        ValueError: tokens or batch < 1, or no text at all.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if tokens < 1:
        raise ValueError(f"prompt tokens must be >= 1, got {tokens}")
    need = tokens + (batch - 1) * REQUEST_SHIFT
    ids: list[int] = []
    chars = 8 * need
    while len(ids) < need:
        text = machine_text(chars)
        ids = tokenizer.encode(text)
        if len(text) < chars:  # all the text there is
            break
        chars *= 2
    have = len(ids)
    if have == 0:
        raise ValueError("this machine's text encodes to no tokens: give --prompt-file")
    if have < need:
        ids = ids * -(-need // have)
    return [ids[i * REQUEST_SHIFT : i * REQUEST_SHIFT + tokens] for i in range(batch)], have
