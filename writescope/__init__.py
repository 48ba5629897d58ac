"""WriteScope: single-GPU runtime for long-context MoE inference.

Python API (shaped like vLLM's)::

    from writescope import LLM, SamplingParams
    llm = LLM("tiny-qwen3-moe")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

from writescope.engine.llm import LLM
from writescope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from writescope.engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
