"""Model presets: the real configurations of the target models and tiny variants of each.

``deepseek-v2-lite``, ``qwen3-30b-a3b``, ``mixtral-8x7b`` are the published config.json files;
``tiny-*`` keep each architecture's structure at small widths (for tests and CPU demos).
"""

from __future__ import annotations

import difflib
import json
from importlib import resources

from writescope.config import ModelConfig

PRESETS = ("deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b", "tiny-deepseek-v2", "tiny-qwen3-moe", "tiny-mixtral")


def preset_hf_dict(name: str) -> dict:
    """The preset's config.json as a dict.

    Raises:
        ValueError: unknown preset (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; {did_you_mean(name)}known presets: {', '.join(PRESETS)}")
    return json.loads(resources.files(__package__).joinpath(f"{name}.json").read_text())


def closest_preset(name: str) -> str | None:
    """The preset closest to ``name`` (case and ``_`` for ``-`` aside), or None when none is close."""
    norm = {p.replace("-", ""): p for p in PRESETS}
    key = name.lower().replace("_", "-")
    close = difflib.get_close_matches(key, list(PRESETS), n=1) or [norm[k] for k in difflib.get_close_matches(key.replace("-", ""), list(norm), n=1)]
    return close[0] if close else None


def did_you_mean(name: str) -> str:
    """``"did you mean 'tiny-qwen3-moe'? "`` for the preset closest to ``name``
    (:func:`closest_preset`), or ``""`` when none is close."""
    close = closest_preset(name)
    return f"did you mean {close!r}? " if close else ""


def preset_config(name: str) -> ModelConfig:
    """The preset's :class:`ModelConfig` (see :func:`preset_hf_dict` for errors)."""
    return ModelConfig.from_hf(preset_hf_dict(name))
