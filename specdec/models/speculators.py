"""The speculators checkpoint format (vllm-project/speculators; what vLLM loads with
``speculative_config={"model": DIR}``) for EAGLE-3 heads (``models/eagle3.py``).

``config.json``: ``speculators_model_type: "eagle3"``, ``architectures: ["Eagle3Speculator"]``,
``transformer_layer_config`` (a Hugging Face config of the head's decoder layers; its ``vocab_size``
is the target's), ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``,
the norm flags (``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``) and
``speculators_config`` (``algorithm``, ``proposal_methods`` such as ``{"proposal_type": "greedy",
"speculative_tokens": K}``, ``default_proposal_method``, ``verifier: {name_or_path, architectures}``).
Weights: ``fc.weight`` [H, n * H_t], ``layers.N.*`` (Hugging Face Llama names; layer 0's q/k/v read
2H and it has a ``hidden_norm``), ``norm.weight``, ``lm_head.weight`` [draft vocab, H], ``d2t``
[draft vocab] int64 offsets (target id = draft id + d2t[draft id]), ``t2d`` [target vocab] bool,
and optionally ``embed_tokens.weight`` (absent: the target's embedding is shared).

Checked against the library itself (speculators 0.9.0 writes ``architectures: ["Eagle3DraftModel"]``,
``target_hidden_size: null``, its own ``embed_tokens`` and ``dtype``): tests/models/test_speculators_interop.py.
A speculators folder given as the model (``LLM(model=DIR)``, as vLLM) runs its verifier with it as the draft
(``override_with_speculators``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdec.models.eagle3 import Eagle3Head, Eagle3Options

SPECULATORS_KEY = "speculators_model_type"
SUPPORTED_TYPES = ("eagle3",)
LAYER_MODEL_TYPES = ("llama", "qwen3")  # decoder layers specdec builds (speculators' model_definitions)


def read_config(path: str | Path) -> dict | None:
    """config.json of a speculators folder, or None for any other folder."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    raw = json.loads(file.read_text())
    return raw if SPECULATORS_KEY in raw else None


def is_speculators_folder(path: str | Path) -> bool:
    return read_config(path) is not None


def speculative_defaults(path: str | Path) -> dict | None:
    """What a speculators checkpoint given as ``speculative_config={"model": DIR}`` alone implies
    (as vLLM reads it): the method and the default proposal method's number of tokens."""
    raw = read_config(path)
    if raw is None:
        return None
    kind = raw[SPECULATORS_KEY]
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"speculators checkpoint {str(path)!r} is of type {kind!r}; specdec loads {SUPPORTED_TYPES}")
    out = {"method": kind}
    spec = raw.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    chosen = next((m for m in methods if m.get("proposal_type") == spec.get("default_proposal_method")),
                  methods[0] if methods else None)
    if chosen is not None and chosen.get("speculative_tokens") is not None:
        out["num_speculative_tokens"] = int(chosen["speculative_tokens"])
    return out


def verifier_path(path: str | Path) -> str:
    """The target a speculators folder names (``speculators_config.verifier.name_or_path``): as vLLM
    reads it (a path from the working directory, or a model name), else a path relative to the folder
    (so a folder shipped beside its target, naming it ``"../target"``, loads from anywhere)."""
    raw = read_config(path) or {}
    name = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not name:
        raise ValueError(f"speculators checkpoint {str(path)!r} names no verifier "
                         f"(speculators_config.verifier.name_or_path); pass the target as model= and the folder "
                         f"as speculative_config={{'model': ...}}")
    if os.path.isabs(name) or os.path.exists(name):
        return name
    local = Path(path) / name
    return str(local.resolve()) if local.exists() else name


def override_with_speculators(model, tokenizer, speculative_config):
    """``LLM(model=<speculators folder>)`` as vLLM reads it: the folder's verifier becomes the
    model (and the tokenizer, unless one is given) and the folder the draft, with the method and K
    the folder implies; the user's ``speculative_config`` fields win except ``method`` and ``model``.
    Anything else passes through unchanged."""
    if not isinstance(model, str) or not os.path.isdir(model) or not is_speculators_folder(model):
        return model, tokenizer, speculative_config
    if isinstance(speculative_config, str):
        try:
            speculative_config = json.loads(speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if speculative_config is not None and not isinstance(speculative_config, dict):
        raise ValueError(f"model {model!r} is a speculators checkpoint: speculative_config may only add fields "
                         f"as a dict, got {type(speculative_config).__name__}")
    implied = speculative_defaults(model)
    spec = {**implied, **(speculative_config or {}), "method": implied["method"], "model": model}
    verifier = verifier_path(model)
    return verifier, tokenizer or verifier, spec


def _layer_config(raw: dict):
    from transformers import AutoConfig

    layer = dict(raw.get("transformer_layer_config") or {})
    model_type = layer.pop("model_type", "llama")
    if model_type not in LAYER_MODEL_TYPES:
        raise ValueError(f"EAGLE-3 transformer_layer_config.model_type {model_type!r} is not supported; "
                         f"specdec builds {LAYER_MODEL_TYPES}")
    for key in ("architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path"):
        layer.pop(key, None)
    return AutoConfig.for_model(model_type, **layer)


def options_from_config(raw: dict, layer_config, num_target_layers: int | None, own_embedding: bool) -> Eagle3Options:
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:  # vLLM's and speculators' default: a low, a middle and a high layer
        if num_target_layers is None:
            raise ValueError("EAGLE-3 config has no eagle_aux_hidden_state_layer_ids")
        ids = default_aux_layer_ids(num_target_layers)
    return Eagle3Options(
        aux_layer_ids=tuple(int(i) for i in ids),
        target_hidden_size=int(raw.get("target_hidden_size") or layer_config.hidden_size),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer_config.vocab_size),
        # absent: True, as vLLM reads it (speculators always writes the flag)
        norm_before_residual=bool(raw.get("norm_before_residual", True)),
        norm_before_fc=bool(raw.get("norm_before_fc", False)), fc_norm=bool(raw.get("fc_norm", False)),
        norm_output=bool(raw.get("norm_output", False)), own_embedding=own_embedding)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """(2, L // 2, L - 3) as vLLM and speculators pick them, clipped into 0..L-1 for shallow targets."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from specdec.models.loader import iterate_weights

    return dict(iterate_weights(str(path)))


def load_eagle3(path: str | Path, target, dtype: torch.dtype, device, attn_backend) -> Eagle3Head:
    """A speculators EAGLE-3 folder -> the head, attached to ``target`` (its embedding when the
    folder has none), in ``dtype`` on ``device``."""
    path = Path(path)
    raw = read_config(path)
    if raw is None or raw[SPECULATORS_KEY] != "eagle3":
        raise ValueError(f"{str(path)!r} is not a speculators EAGLE-3 checkpoint (config.json needs "
                         f"{SPECULATORS_KEY}: 'eagle3')")
    weights = _read_weights(path)
    layer_config = _layer_config(raw)
    options = options_from_config(raw, layer_config, target.config.num_hidden_layers,
                                  own_embedding="embed_tokens.weight" in weights)
    head = Eagle3Head(layer_config, options, attn_backend)
    head.load_weights(weights.items())
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)  # d2t stays int64
    head.rotary.reset_tables()
    head.attach(target)
    return head


def layer_config_dict(config) -> dict:
    """The head's layer config as speculators writes it (``to_diff_dict``), plus the flat
    ``rope_theta`` older readers expect."""
    out = config.to_diff_dict()
    out.pop("transformers_version", None)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        out.setdefault("rope_theta", params["rope_theta"])
    return out


def save_eagle3(head: Eagle3Head, out: str | Path, verifier: str, verifier_architectures: list[str],
                num_speculative_tokens: int, extra: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``head`` as a speculators folder (atomic: a temporary folder, then swapped in).
    ``extra``: more top-level config entries (speculators' config keeps unknown keys)."""
    import shutil

    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    o = head.options
    config = {
        "architectures": ["Eagle3Speculator"], SPECULATORS_KEY: "eagle3",
        "transformer_layer_config": layer_config_dict(head.config),
        "draft_vocab_size": o.draft_vocab_size, "target_hidden_size": o.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(o.aux_layer_ids), "norm_before_residual": o.norm_before_residual,
        "norm_before_fc": o.norm_before_fc, "fc_norm": o.fc_norm, "norm_output": o.norm_output,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": str(dtype).removeprefix("torch."), **(extra or {}),
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in head.state_dict_hf().items()}
    save_file({k: v.cpu().contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
