"""Where WriteScope keeps what it builds once per machine (tokenizers, calibrations)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/writescope/<name>`` (default ``~/.cache``); not created here."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "writescope" / name
