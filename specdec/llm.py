"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)`` and ``.chat(...)``."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from specdec.config import EngineConfig
from specdec.engine.engine_core import EngineCore
from specdec.lora.request import LoRARequest
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.worker.shared_weights import SharedWeights

PromptType = str | list[int]


class LLM:
    """vLLM-compatible offline entry point. Keyword arguments are ``EngineConfig`` fields,
    plus ``speculative_config`` (dict / JSON) or the older ``speculative_model`` +
    ``num_speculative_tokens``. ``target_weights``: a ``SharedWeights`` that hands this engine
    the target's weights another engine of the process loaded, or keeps the ones this engine
    loads (benchmarks comparing proposers on one copy of the model)."""

    def __init__(self, model: str | None = None, target_weights: SharedWeights | None = None, **kwargs):
        if model is None:
            from specdec.models.default import default_engine_kwargs

            model, defaults = default_engine_kwargs()
            for key, value in defaults.items():
                kwargs.setdefault(key, value)
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        self.engine = EngineCore(self.config, target_weights)
        self._counter = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults applied."""
        return SamplingParams(**self.engine.generation_defaults)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):  # vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._encode(prompt["prompt"])
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: the adapter every prompt runs with, or one per prompt (None: the base
        model); needs ``enable_lora=True``."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        loras = _per_prompt_lora(lora_request, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        for lora in loras:
            self.engine.validate_lora(lora)
        for (_, ids), sp in zip(encoded, params):  # validate everything before anything is queued
            self.engine.validate_prompt(ids)
            if sp.structured_outputs is not None:  # compiled once: add_request finds it in the cache
                self.engine.compile_grammar(sp.structured_outputs)
        ids = []
        for (text, token_ids), sp, lora in zip(encoded, params, loras):
            rid = str(next(self._counter))
            self.engine.add_request(rid, token_ids, sp, prompt=text, lora_request=lora)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        self.engine.closed_batch = self.engine.final_outputs_only = True
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request(ids)  # an interrupted generate leaves no request behind
            raise
        finally:
            self.engine.closed_batch = self.engine.final_outputs_only = False
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``tools``: OpenAI tool definitions (``{"type": "function", "function": {...}}``), given to
        the chat template; read calls from the output with ``specdec.tool_parsers``. ``lora_request``:
        as in ``generate``, one per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template, tools) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None) -> list[int]:
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template=...")
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def get_metrics(self) -> dict:
        return self.engine.get_metrics()

    def apply_model(self, fn) -> list:
        """``fn(target model)`` on every rank, in rank order (vLLM's name): inspect the model as
        loaded (packed, quantized) without reaching into the engine."""
        return self.engine.executor.apply_model(fn)

def _per_prompt_lora(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, str):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or None, "
                         f"got {type(lora_request).__name__}")
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {len(loras)} lora_request entries for {num_prompts} prompts")
    return loras
