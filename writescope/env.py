"""Switches read from the environment (``WRITESCOPE_*``): one reader, one error wording."""

from __future__ import annotations

import math
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


def env_int(name: str, low: int, high: int, use: str) -> int | None:
    """The integer value of the environment variable ``name`` (stripped), from ``low`` to ``high``;
    None where it is unset or empty.

    Raises:
        ValueError: not such an integer, naming the variable and the value, then ``use`` (what to
            write instead, e.g. "use an integer from 1 to 64 (default 2)").
    """
    return _env_value(name, int, lambda v: low <= v <= high, use)


def env_float(name: str, low: float, use: str) -> float | None:
    """The finite number in the environment variable ``name`` (stripped), at least ``low``; None
    where it is unset or empty.

    Raises:
        ValueError: not a number, below ``low``, NaN or infinite, naming the variable and the value,
            then ``use``.
    """
    return _env_value(name, float, lambda v: low <= v < math.inf, use)  # NaN fails the comparison


def _env_value(name: str, convert, accept, use: str):
    """``convert`` of the stripped value of ``name`` where ``accept`` takes it; None where unset or
    empty; else ValueError naming the variable and the value, then ``use``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = convert(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: {use}") from None
    if not accept(value):
        raise ValueError(f"{name}={raw!r}: {use}")
    return value
