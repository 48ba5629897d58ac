"""Sizes written by people (``--vram-budget 32GiB``, ``WRITESCOPE_PINNED_POOL=8GiB``) read as bytes."""

from __future__ import annotations

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_size(text: str) -> int:
    """``"32GiB"``, ``"32G"`` (binary), ``"30GB"`` (decimal), ``"512MiB"``, ``"1073741824"`` -> bytes.

    Raises:
        ValueError: not a positive size with a known unit.
    """
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a size: use e.g. 32GiB, 24G, 30GB or 512MiB") from None
    if value < 1:
        raise ValueError(f"a size must be positive, got {text!r}")
    return int(value)


def parse_budget(text: str) -> int:
    """A memory budget: :func:`parse_size`, where a bare number under 1 MiB is refused as a
    forgotten unit (``"32"`` meant as 32 GiB would be 32 bytes).

    Raises:
        ValueError: as :func:`parse_size`, or a bare number under 1 MiB (names the value and a
            spelling with a unit).
    """
    value = parse_size(text)
    t = text.strip()
    if value < 2**20 and t.replace(".", "", 1).isdigit():
        raise ValueError(f"{t!r} has no unit, so it would be {value:,} byte{'' if value == 1 else 's'}: give one, e.g. {t}GiB")
    return value
