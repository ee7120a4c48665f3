"""mini_engine: a small vLLM-style inference engine for Qwen3."""
__version__ = "0.1.0"     # pyproject.toml reads it (setuptools' dynamic version)

from mini_engine.async_llm import AsyncLLM
from mini_engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from mini_engine.compilation_config import CompilationConfig
from mini_engine.llm import LLM
from mini_engine.logits_processors import (AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, MoveDirectionality,
                                         process_dict_updates)
from mini_engine.lora import LoRARequest
from mini_engine.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                                 EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, RequestOutput,
                                 ScoringOutput, ScoringRequestOutput)
from mini_engine.pooling_params import PoolingParams
from mini_engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput",
           "EmbeddingOutput", "ScoringRequestOutput", "ScoringOutput", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "ClassificationRequestOutput", "ClassificationOutput", "PoolingRequestOutput",
           "PoolingOutput", "LogitsProcessor", "AdapterLogitsProcessor", "BatchUpdate", "MoveDirectionality",
           "process_dict_updates", "AsyncLLM", "RequestOutputKind", "CompilationConfig"]
