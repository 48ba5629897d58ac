"""WriteScope: single-GPU runtime for long-context MoE inference.

Python API (shaped like vLLM's)::

    from writescope import LLM, SamplingParams
    llm = LLM("tiny-qwen3-moe")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from writescope.engine import CompletionOutput, LLM, RequestMetrics, RequestOutput, SamplingParams


def __getattr__(name: str):
    """The public names, imported on first use (PEP 562) from :mod:`writescope.engine`, so that
    ``writescope --version`` and ``--help`` do not import torch (seconds)."""
    if name not in __all__:
        raise AttributeError(f"module 'writescope' has no attribute {name!r}")
    from writescope import engine

    value = getattr(engine, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
