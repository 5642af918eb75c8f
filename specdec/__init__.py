"""specdec: an LLM inference engine built around lossless speculative decoding."""
from specdec.llm import LLM
from specdec.lora.request import LoRARequest
from specdec.outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from specdec.sampling_params import SamplingParams
from specdec.structured_output import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "SpecDecodeStats", "__version__"]
