"""Error wording shared by the Python API and the CLI: argument names for the interface used, and
plurals ("1 token", "2 tokens")."""

from __future__ import annotations

import re
from typing import Mapping


def plural(n: int, word: str, words: str | None = None) -> str:
    """``"1 token"``, ``"2 tokens"`` (``words``: an irregular plural)."""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


class ArgError(ValueError):
    """A bad argument, worded with the Python API's argument names (``str(e)``), which
    :meth:`worded` rewrites as the CLI's flags.

    ``names`` are the API argument names the message mentions as whole words; one followed by an
    index (``prompts[2]``) is rewritten with the request it names (``--prompt (request 2)``).
    """

    def __init__(self, message: str, *names: str):
        super().__init__(message)
        self.message, self.names = message, names

    def worded(self, flags: Mapping[str, str], requests: bool = True) -> str:
        """The message with each name replaced by ``flags[name]``, else by ``--name-with-dashes``;
        ``requests`` False: an index dropped, not said as a request (a server's request has one prompt)."""
        out = self.message
        for name in self.names:
            flag = flags.get(name, "--" + name.replace("_", "-"))
            # a standalone word only: not inside a path, a quoted value or a hyphenated name
            out = re.sub(rf"(?<![\w\-/.'\"]){re.escape(name)}(?![\w\-/.'\"])(\[(\d+)\])?",
                         lambda m: flag if m.group(2) is None or not requests else f"{flag} (request {m.group(2)})", out)
        return out
