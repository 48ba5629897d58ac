"""The user-facing engine: model loading, sampling, the generate loop (``LLM``, ``SamplingParams``,
``RequestOutput``; also exported by ``writescope``).

The names are imported on first use (PEP 562): importing a module of this package (``threads``,
``timing``) from below the engine must not import the engine itself, which imports the rest of
the runtime."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]

_HOMES = {"LLM": "writescope.engine.llm", "SamplingParams": "writescope.engine.sampling", "RequestOutput": "writescope.engine.outputs",
          "CompletionOutput": "writescope.engine.outputs", "RequestMetrics": "writescope.engine.outputs"}

if TYPE_CHECKING:
    from writescope.engine.llm import LLM
    from writescope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from writescope.engine.sampling import SamplingParams


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'writescope.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
