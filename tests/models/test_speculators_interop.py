"""A speculators checkpoint written by the speculators library itself (vllm-project/speculators
0.9.0, ``scripts/make_speculators_fixture.py``; fixture in tests/fixtures/speculators_eagle3) loads
in specdec: the loader reads the config as the library wrote it, the head reproduces the library's
own forward (its logits at every training-time-test step), and greedy output with it equals plain
decoding, given as ``speculative_config`` and, as in vLLM, as ``LLM(model=<speculators folder>)``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.layers.attention import TORCH_BACKEND
from specdec.models.eagle3_dense import DenseSteps, hf_aux_states
from specdec.models.loader import load_model
from specdec.models.speculators import load_eagle3, read_config, verifier_path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "speculators_eagle3"
TARGET, HEAD = str(FIXTURE / "target"), str(FIXTURE / "eagle3")
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128)
CPU = torch.device("cpu")
PROMPTS = ["the quick brown fox", "def f(x):", "hello world, hello", "a", "import json as j",
           "speculative decoding is lossless", "zzz", "1 + 2 = 3; 4 + 5 ="]


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET, torch.float32, CPU)


@pytest.fixture(scope="module")
def head(target):
    return load_eagle3(HEAD, target, torch.float32, CPU, TORCH_BACKEND)


@pytest.fixture(scope="module")
def reference():
    from safetensors.torch import load_file

    return load_file(str(FIXTURE / "reference.safetensors"))


@pytest.fixture(scope="module")
def want():
    """Plain greedy decoding of the target."""
    plain = LLM(model=TARGET, **ENGINE)
    outs = plain.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_loader_reads_the_config_as_the_library_wrote_it(head):
    from safetensors.torch import load_file

    raw = read_config(HEAD)
    assert raw["speculators_version"] == "0.9.0" and raw["architectures"] == ["Eagle3DraftModel"]
    o = head.options
    assert o.aux_layer_ids == tuple(raw["eagle_aux_hidden_state_layer_ids"]) == (2, 1, 0)  # the library's default
    assert o.draft_vocab_size == raw["draft_vocab_size"] == 128
    assert raw["target_hidden_size"] is None and o.target_hidden_size == 64  # null: the head's own width
    assert (o.norm_before_residual, o.norm_before_fc, o.fc_norm, o.norm_output) == (
        raw["norm_before_residual"], raw["norm_before_fc"], raw["fc_norm"], raw["norm_output"]) == (
        False, False, True, True)
    assert o.own_embedding and len(head.layers) == raw["transformer_layer_config"]["num_hidden_layers"] == 2
    weights = load_file(str(Path(HEAD) / "model.safetensors"))
    d2t, t2d = weights["d2t"], weights["t2d"]
    # d2t holds offsets: target id = draft id + d2t[draft id]; t2d marks the same target ids
    assert torch.equal(head.draft_to_target, torch.arange(128) + d2t)
    assert torch.equal(torch.nonzero(t2d).flatten(), head.draft_to_target)
    assert torch.equal(head.d2t, d2t)
    # the library copied the target's LM head rows of the draft vocabulary and its embedding
    target_weights = load_file(str(Path(TARGET) / "model.safetensors"))
    torch.testing.assert_close(head.lm_head.weight, target_weights["lm_head.weight"][head.draft_to_target].float())
    torch.testing.assert_close(head.embed_tokens.weight, target_weights["model.embed_tokens.weight"].float())


def test_head_reproduces_the_librarys_forward(target, head, reference):
    """The library's Eagle3DraftModel.forward (teacher-forced training-time-test steps) equals
    DenseSteps over the same states, step by step: every weight, norm flag and the aux order."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    tokens, want = reference["tokens"], reference["logits"]  # [S + 1], [steps, S, draft vocab]
    s = len(tokens) - 1
    with torch.no_grad():
        _, aux = hf_aux_states(hf, tokens[None], head.options.aux_layer_ids)
        steps = DenseSteps(head, 1, s)
        out = steps.step(tokens[None, 1:], head.combine(aux[:, :-1]))
        for j in range(want.shape[0]):
            torch.testing.assert_close(head.draft_logits(out[0]), want[j], rtol=1e-4, atol=1e-4)
            shifted = torch.cat([tokens[2 + j:], tokens.new_zeros(2 + j)])[None, :s]  # the library's teacher forcing
            out = steps.step(shifted, out)
    assert want[0].argmax(-1).unique().numel() > 3  # the drafts vary from row to row


@pytest.mark.parametrize("tree", [{}, {"tree_topk": 3, "tree_nodes": 8}], ids=["chain", "tree"])
def test_greedy_identical_with_the_librarys_head(want, tree):
    llm = LLM(model=TARGET, **ENGINE, speculative_config={"method": "eagle3", "model": HEAD,
                                                          "num_speculative_tokens": 3, **tree})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    metrics = llm.get_metrics()
    assert metrics["num_draft_tokens"] > 0


def test_llm_of_the_speculators_folder_alone(want, tmp_path):
    """As vLLM: LLM(model=<speculators folder>) runs its verifier with it. The fixture names its
    verifier "../target", a path relative to the speculators folder; an absolute path works too."""
    assert verifier_path(HEAD) == str(Path(TARGET).resolve())
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=HEAD, **ENGINE)
    cfg = llm.engine.config
    assert Path(cfg.model).resolve() == Path(TARGET).resolve() and cfg.tokenizer == cfg.model
    assert (cfg.speculative_config.method, cfg.speculative_config.model) == ("eagle3", HEAD)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == want
    copy = tmp_path / "head"
    shutil.copytree(HEAD, copy)
    raw = json.loads((copy / "config.json").read_text())
    raw["speculators_config"]["verifier"]["name_or_path"] = TARGET
    (copy / "config.json").write_text(json.dumps(raw))
    llm = LLM(model=str(copy), **ENGINE, speculative_config={"num_speculative_tokens": 2, "tree_topk": 2})
    spec = llm.engine.config.speculative_config
    assert (llm.engine.config.model, spec.model, spec.num_speculative_tokens, spec.tree_topk) == (
        TARGET, str(copy), 2, 2)  # the user's fields win, the folder stays the draft
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy, use_tqdm=False)] == want[:3]
