"""pdserve.engine: one process's model runtime (docs/architecture.md, Layout).

The offline API mirrors vLLM's: ``LLM``, ``SamplingParams``, ``RequestOutput``.
"""

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_outputs import EngineOutput
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pdserve.engine.sampling_params import SamplingParams

__all__ = [
           "LLM",
           "CompletionOutput",
           "EngineConfig",
           "EngineOutput",
           "LLMEngine",
           "RequestOutput",
           "SamplingParams",
           "TokenLogprob",
]
