"""The path a decode step's host experts took, as the meter of O keys its samples
(scheduler/other_work.py): O differs by path (the stage waits for the CPU's experts, or the link reads
them inside it), so each is tracked apart. Kept here, apart from the meter, so the balance
(scheduler/roofline.py), which the meter imports, can name a path too."""

from __future__ import annotations


def expert_path(link_share: float | None) -> str:
    """The path of a step's host experts from the share the link read of them: ``"cpu"`` under
    one half (the CPU computes most), ``"link"`` from one half, ``""`` with no host experts (None)."""
    if link_share is None:
        return ""
    return "cpu" if link_share < 0.5 else "link"


def path_signature(switches: str, path: str) -> str:
    """The store's key for O of steps under ``switches`` (``other_work.switch_signature``) whose host
    experts took ``path`` (:func:`expert_path`): the switches alone where there are no host experts
    (the key O had before it was kept per path), else with ``experts=PATH`` appended."""
    if not path:
        return switches
    return f"{switches},experts={path}" if switches else f"experts={path}"
