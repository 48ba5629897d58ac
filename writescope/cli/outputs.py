"""Checks on the command line's output paths and on values argparse would misread, made before
any work starts (a long run must not be thrown away at its end for a path it cannot write)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# what argparse already takes as a negative number (its parser's ``_negative_number_matcher``)
_ARGPARSE_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$")
_NEGATIVE_WITH_UNIT = re.compile(r"^-\.?\d")


def check_output_file(path: Path | None, flag: str) -> None:
    """Nothing for ``None``; otherwise check that ``path`` can be written as a file. Nothing is
    created (no empty file is left behind on a later failure).

    Raises:
        ValueError: naming ``flag`` and the path: the path is a directory, its directory does not
            exist or is not a directory, or the directory or an existing file is not writable.
    """
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory: give a file path")
    _check_parent(path, flag)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: the file exists and is not writable: give another path")


def check_output_dir(path: Path, flag: str) -> None:
    """Check that ``path`` can be made (or, existing, written into) as a directory; nothing is created.

    Raises:
        ValueError: naming ``flag`` and the path: it is a file, it or its parent is not writable,
            or its parent does not exist.
    """
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag} {path}: is a file, not a directory: give a directory path")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: directory {path} is not writable: give another path")
        return
    _check_parent(path, flag)


def _check_parent(path: Path, flag: str) -> None:
    parent = path.parent  # "." for a bare file name
    if not parent.exists():
        raise ValueError(f"{flag} {path}: directory {path.parent} does not exist: create it first (mkdir -p {path.parent}) "
                         "or give another path")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {path.parent} is not a directory: give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: directory {path.parent} is not writable: give another path")


def attach_negative_values(argv: list[str]) -> list[str]:
    """``["--vram-budget", "-1GiB"]`` -> ``["--vram-budget=-1GiB"]``: argparse reads a value
    that starts with '-' and is not a plain negative number (``-1GiB``, ``-2k``) as an unknown
    option and reports the flag's argument as missing; attached, the value reaches the flag's
    own check (a size must be positive, a token count >= 1). Plain numbers (``-1``, ``-0.5``)
    argparse reads itself and are left as they are, and so is everything after ``--``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return out + argv[i:]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (tok.startswith("--") and "=" not in tok and nxt is not None
                and _NEGATIVE_WITH_UNIT.match(nxt) and not _ARGPARSE_NEGATIVE.match(nxt)):
            out.append(f"{tok}={nxt}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out
