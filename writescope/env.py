"""Switches read from the environment (``WRITESCOPE_*``): one reader, one error wording."""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of the environment variable ``name``, lower-cased and stripped, one of ``choices``
    (the first is the default when it is unset).

    Raises:
        ValueError: another value, naming the variable, the value and the choices.
    """
    value = os.environ.get(name, choices[0]).strip().lower()
    if value not in choices:
        rest = " or ".join(f"'{c}'" for c in choices[1:])
        raise ValueError(f"{name}={value!r}: use '{choices[0]}' (the default) or {rest}")
    return value
