"""The configurations ``specdec bench peers`` runs: one line each, per engine.

A ``PeerConfig`` names the engine, the configuration, the key it is compared on across engines
(``match``: the same model format and speculation, e.g. "bf16 draft K=5") and the engine's own
settings. ``requires`` names what must be present for it to run: a quantization method of
specdec's target (read from ``specdec.config.QUANTIZATION_METHODS``, so a method added there turns
its line on) or a GGUF file kind for llama.cpp. Adding a configuration is adding one line here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SPECDEC, VLLM, LLAMA_CPP = "specdec", "vllm", "llama.cpp"
ENGINES = (SPECDEC, VLLM, LLAMA_CPP)


@dataclass(frozen=True)
class PeerConfig:
    engine: str
    name: str
    match: str | None = None  # configurations with the same key are compared across engines
    options: dict = field(default_factory=dict)  # engine-specific, see each runner
    requires: str | None = None  # "quantization:int4", "gguf:bf16", ...
    speculative: bool = False

    @property
    def label(self) -> str:
        return f"{self.engine}: {self.name}"


def _draft(k: int = 5, **extra) -> dict:
    return {"method": "draft_model", "model": "{draft}", "num_speculative_tokens": k, **extra}


NGRAM_K5 = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4}

# batch 1, decode tokens/s over the 8 code prompts
BATCH1_CONFIGS = (
    PeerConfig(SPECDEC, "bf16 plain", "bf16 plain", {"dtype": "auto"}),
    # what a vLLM user passes: must get the machine's fastest bf16 path, held against llama.cpp's bf16
    PeerConfig(SPECDEC, 'dtype="bfloat16" plain', None, {"dtype": "bfloat16"}),
    PeerConfig(SPECDEC, "bf16 + bf16 draft K=5", "bf16 draft K=5", {"speculative_config": _draft()}, speculative=True),
    PeerConfig(SPECDEC, "bf16 + int8 draft K=5", None, {"speculative_config": _draft(quantization="int8")},
               speculative=True),
    PeerConfig(SPECDEC, "bf16 + int8 draft K auto", None,
               {"speculative_config": _draft("auto", quantization="int8", max_num_speculative_tokens=5)},
               speculative=True),
    PeerConfig(SPECDEC, "int8 target plain", None, {"quantization": "int8"}, "quantization:int8"),
    PeerConfig(SPECDEC, "int8 target + int8 draft K=5", None,
               {"quantization": "int8", "speculative_config": _draft(quantization="int8")}, "quantization:int8",
               speculative=True),
    PeerConfig(SPECDEC, "int4 target plain", None, {"quantization": "int4"}, "quantization:int4"),
    PeerConfig(SPECDEC, "int4 target + int8 draft K=5", None,
               {"quantization": "int4", "speculative_config": _draft(quantization="int8")}, "quantization:int4",
               speculative=True),
    # the llama.cpp user's files, their quantized linears kept (Q4_K / Q6_K / Q5_0 / Q8_0 kernels)
    PeerConfig(SPECDEC, "Q4_K_M gguf plain", "Q4_K_M plain", {"model": "{target_q4_k_m}"}, "gguf:q4_k_m"),
    PeerConfig(SPECDEC, "Q4_K_M gguf + Q4_K_M gguf draft K=5", "Q4_K_M draft K=5",
               {"model": "{target_q4_k_m}", "speculative_config": {**_draft(), "model": "{draft_q4_k_m}"},
                "draft_gguf": "q4_k_m"}, "gguf:q4_k_m", speculative=True),
    # the same files with int8 activations (llama.cpp's arithmetic), still lossless: README
    PeerConfig(SPECDEC, "Q4_K_M gguf w4a8 plain", None, {"model": "{target_q4_k_m}", "quantization": "w4a8"},
               "gguf:q4_k_m"),
    PeerConfig(SPECDEC, "Q4_K_M gguf w4a8 + Q4_K_M gguf w4a8 draft K=5", None,
               {"model": "{target_q4_k_m}", "quantization": "w4a8",
                "speculative_config": {**_draft(), "model": "{draft_q4_k_m}", "quantization": "w4a8"},
                "draft_gguf": "q4_k_m"}, "gguf:q4_k_m", speculative=True),
    # the draft need not match any file: its bf16 checkpoint requantized to int4 (groups of 32,
    # int8 head) reads fewer bytes than its Q4_K_M file's kept formats (Q5_0 runs as int8)
    PeerConfig(SPECDEC, "Q4_K_M gguf w4a8 + w4a8 draft K=5", None,
               {"model": "{target_q4_k_m}", "quantization": "w4a8",
                "speculative_config": {**_draft(), "quantization": "w4a8"}}, "gguf:q4_k_m", speculative=True),
    # the draft's LM head cut to 49,152 of its 151,936 tokens (draft_vocab_size: README), one more draft
    PeerConfig(SPECDEC, "Q4_K_M gguf w4a8 + w4a8 draft (49k vocab) K=6", None,
               {"model": "{target_q4_k_m}", "quantization": "w4a8",
                "speculative_config": {**_draft(6), "quantization": "w4a8", "draft_vocab_size": 49152}},
               "gguf:q4_k_m", speculative=True),
    PeerConfig(SPECDEC, "Q4_K_M gguf w4a8 + w4a8 draft K auto", None,
               {"model": "{target_q4_k_m}", "quantization": "w4a8",
                "speculative_config": {**_draft("auto", max_num_speculative_tokens=8), "quantization": "w4a8"}},
               "gguf:q4_k_m", speculative=True),
    # "auto" with the best fixed K's draft: the line to hold against that K (or ``specdec bench autok``)
    PeerConfig(SPECDEC, "Q4_K_M gguf w4a8 + w4a8 draft (49k vocab) K auto", None,
               {"model": "{target_q4_k_m}", "quantization": "w4a8",
                "speculative_config": {**_draft("auto", max_num_speculative_tokens=8), "quantization": "w4a8",
                                       "draft_vocab_size": 49152}},
               "gguf:q4_k_m", speculative=True),
    PeerConfig(VLLM, "bf16 plain", "bf16 plain", {}),
    PeerConfig(VLLM, "bf16 + bf16 draft K=5", "bf16 draft K=5", {"speculative_config": _draft()}, speculative=True),
    PeerConfig(VLLM, "n-gram K=5", "n-gram K=5", {"speculative_config": NGRAM_K5}, speculative=True),
    PeerConfig(LLAMA_CPP, "Q4_K_M plain", "Q4_K_M plain", {"gguf": "q4_k_m"}, "gguf:q4_k_m"),
    PeerConfig(LLAMA_CPP, "Q8_0 plain", "Q8_0 plain", {"gguf": "q8_0"}, "gguf:q8_0"),
    PeerConfig(LLAMA_CPP, "bf16 plain", "bf16 plain", {"gguf": "bf16"}, "gguf:bf16"),
    PeerConfig(LLAMA_CPP, "Q4_K_M + Q4_K_M draft, draft-max 5", "Q4_K_M draft K=5",
               {"gguf": "q4_k_m", "draft_gguf": "q4_k_m",
                # --spec-type defaults to none; --spec-draft-n-max is --draft-max's new name
                "server_args": ["--spec-type", "draft-simple", "--spec-draft-n-max", "5", "--spec-draft-n-min", "0"]},
               "gguf:q4_k_m", speculative=True),
    PeerConfig(LLAMA_CPP, "Q4_K_M plain (llama-bench tg128)", None, {"gguf": "q4_k_m", "tool": "llama-bench"},
               "gguf:q4_k_m"),
    PeerConfig(LLAMA_CPP, "bf16 plain (llama-bench tg128)", None, {"gguf": "bf16", "tool": "llama-bench"},
               "gguf:bf16"),
)

# one batch of 32 prompts, total output tokens/s (prefill included)
BATCH_CONFIGS = (
    PeerConfig(SPECDEC, "bf16 plain", "bf16 plain", {"dtype": "auto"}),
    PeerConfig(SPECDEC, "n-gram K=5", "n-gram K=5", {"speculative_config": NGRAM_K5}, speculative=True),
    PeerConfig(VLLM, "bf16 plain", "bf16 plain", {}),
    PeerConfig(VLLM, "n-gram K=5", "n-gram K=5", {"speculative_config": NGRAM_K5}, speculative=True),
)

REFERENCE = (LLAMA_CPP, "Q4_K_M plain")  # every batch-1 row's ratio column is against this one


def quantization_methods() -> tuple:
    from specdec.config import QUANTIZATION_METHODS

    return tuple(m for m in QUANTIZATION_METHODS if m)


def missing_requirement(config: PeerConfig, ggufs: dict) -> str | None:
    """Why ``config`` cannot run in this checkout / with these GGUF files, or None."""
    if config.requires is None:
        return None
    what, _, value = config.requires.partition(":")
    if what == "quantization" and value not in quantization_methods():
        return f"specdec's target quantization has no {value!r} in this checkout ({quantization_methods()})"
    if what == "gguf" and not ggufs.get(value):
        return ggufs.get(f"{value}_why") or f"no {value} GGUF of the target"
    for key in ("draft_gguf",):
        if key in config.options and not ggufs.get(f"draft_{config.options[key]}"):
            return f"no {config.options[key]} GGUF of the draft"
    return None


def select(configs, engines=None, only=None) -> list[PeerConfig]:
    """Filter by engine and by substrings of the label (``--only``)."""
    out = [c for c in configs if engines is None or c.engine in engines]
    if only:
        out = [c for c in out if any(s.lower() in c.label.lower() for s in only)]
    return out


def substitute(value, names: dict):
    """Fill ``{draft}`` / ``{target}`` placeholders in a nested config."""
    if isinstance(value, str):
        return value.format(**names) if "{" in value else value
    if isinstance(value, dict):
        return {k: substitute(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, names) for v in value]
    return value
