"""The user-facing engine: model loading, sampling, the generate loop (``LLM``, ``SamplingParams``,
``RequestOutput``; also exported by ``writescope``)."""

from writescope.engine.llm import LLM
from writescope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from writescope.engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
