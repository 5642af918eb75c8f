"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from specdec.models.gemma3 import Gemma3ForCausalLM
from specdec.models.gpt_oss import GptOssForCausalLM
from specdec.models.llama import LlamaForCausalLM
from specdec.models.mistral import MistralForCausalLM
from specdec.models.mixtral import MixtralForCausalLM
from specdec.models.phi3 import Phi3ForCausalLM
from specdec.models.qwen2 import Qwen2ForCausalLM
from specdec.models.qwen3 import Qwen3ForCausalLM
from specdec.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def get_model_class(config) -> type[LlamaForCausalLM]:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {archs or '(none in config.json)'}; supported: {sorted(MODEL_REGISTRY)}"
    )
