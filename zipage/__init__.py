"""Zipage: an LLM inference engine for long reasoning."""

from zipage.config import CacheConfig, CompressionConfig, EngineConfig, SchedulerConfig
from zipage.llm import LLM
from zipage.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestsFailed
from zipage.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "RequestsFailed",
           "EngineConfig", "CacheConfig", "SchedulerConfig", "CompressionConfig"]
__version__ = "0.1.0"
