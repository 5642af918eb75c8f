"""EAGLE-3 heads (float32): the target exports the auxiliary layers' inputs as transformers computes
them, the paged head equals its dense reference, the engine's drafts are exactly what the dense head
drafts from those states (chains and trees), and greedy output with an EAGLE-3 head is
token-identical to plain decoding."""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.layers.attention import TORCH_BACKEND
from specdec.models.eagle3_dense import DenseSteps, dense_drafts, hf_aux_states
from specdec.models.loader import load_model
from specdec.models.speculators import load_eagle3, save_eagle3
from specdec.training.train_eagle3 import init_eagle3
from specdec.worker.model_runner import ModelRunner

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128)
CPU = torch.device("cpu")
LAYERS = (1, 2, 3)


@pytest.fixture(scope="module")
def target_path(make_model) -> str:
    """Four layers, so the head reads three distinct layers as it would on a real target."""
    return make_model("llama_4l", arch="llama", num_layers=4, initializer_range=0.05, random_norms_and_biases=True)


@pytest.fixture(scope="module")
def target(target_path):
    return load_model(target_path, torch.float32, CPU)


@pytest.fixture(scope="module")
def hf(target_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()


def make_head_folder(target, out, num_layers: int = 1, seed: int = 1, num_speculative_tokens: int = 3) -> str:
    """A random head over a 240-token draft vocabulary, its weights scaled up so its drafts differ
    from row to row (a fresh head's are nearly constant)."""
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:240].sort().values
    head = init_eagle3(target, LAYERS, vocab, num_layers=num_layers, seed=seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2 and not name.startswith("lm_head"):
                p.mul_(8.0)
    save_eagle3(head, out, "tiny-target", ["LlamaForCausalLM"], num_speculative_tokens, dtype=torch.float32)
    return str(out)


@pytest.fixture(scope="module")
def head_path(target, tmp_path_factory) -> str:
    return make_head_folder(target, tmp_path_factory.mktemp("eagle3") / "head")


def test_target_exports_the_auxiliary_layers_inputs(target, hf):
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (17,))
    runner = ModelRunner(target, num_blocks=8, block_size=4, device=CPU, dtype=torch.float32, aux_layers=(0, 3, 1))
    batch = runner.prepare([ids.tolist()], [0], [[2, 5, 0, 7, 1]], [[16]])
    logits, exported = runner.forward_with_hidden(batch)
    with torch.no_grad():
        want_logits, want = hf_aux_states(hf, ids[None], (0, 3, 1))
    assert exported.shape == (17, 3 * target.config.hidden_size)
    torch.testing.assert_close(exported, want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[0], want_logits[0, -1], rtol=1e-4, atol=1e-4)
    plain = ModelRunner(target, num_blocks=8, block_size=4, device=CPU, dtype=torch.float32)
    assert plain.forward_with_hidden(batch)[1].shape == (17, target.config.hidden_size)  # no aux: final states


@pytest.mark.parametrize("num_layers", [1, 2])
def test_paged_head_matches_dense_steps(target, tmp_path, num_layers):
    """Catch-up chunks then two draft passes of the paged head equal DenseSteps at the last row."""
    head = load_eagle3(make_head_folder(target, tmp_path / "h", num_layers), target, torch.float32, CPU, TORCH_BACKEND)
    torch.manual_seed(0)
    n = 15
    ids = torch.randint(0, 300, (n + 1,))
    g = torch.randn(n, head.config.hidden_size)
    runner = ModelRunner(head, num_blocks=8, block_size=4, device=CPU, dtype=torch.float32)
    table = [3, 1, 7, 0, 2, 5]
    got = []
    for lo, hi in [(0, 9), (9, 10), (10, n)]:  # a prompt, one decode row, a catch-up run
        batch = runner.prepare([ids[lo + 1:hi + 1].tolist()], [lo], [table], [list(range(hi - lo))])
        batch.features = g[lo:hi]
        got.append(runner.forward_with_hidden(batch)[1])
    steps = DenseSteps(head, 1, n)
    with torch.no_grad():
        want = steps.step(ids[None, 1:], g[None])[0]
        torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)
        out, last = want, got[-1][-1]
        for j, tok in enumerate([17, 250]):  # draft passes at positions n, n + 1, fed the last output
            batch = runner.prepare([[tok]], [n - 1 + j + 1], [table], [[0]])
            batch.features = last[None]
            last = runner.forward_with_hidden(batch)[1][0]
            out = steps.step(torch.full((1, n), tok), out)
            torch.testing.assert_close(last, out[0, -1], rtol=1e-4, atol=1e-4)


def _recording(llm, seen: list) -> None:
    """Record (tokens, num_computed, K, drafts, parents) of every proposal the engine makes."""
    proposer = llm.engine.executor.driver_worker.proposer
    inner = proposer.propose

    def recording(requests, num_spec, tree_budget=None, **kw):
        snapshot = [(list(r.all_token_ids), r.num_computed_tokens, k) for r, k in zip(requests, num_spec)]
        proposal = inner(requests, num_spec, tree_budget, **kw)
        parents = proposal.draft_parents or [None] * len(requests)
        seen.extend((t, c, k, d, p) for (t, c, k), d, p in zip(snapshot, proposal.draft_token_ids, parents) if d)
        return proposal

    proposer.propose = recording


def test_engine_chain_drafts_equal_the_dense_heads(target_path, head_path, target, hf, prompts):
    llm = LLM(model=target_path, **ENGINE, speculative_config={"method": "eagle3", "model": head_path,
                                                               "num_speculative_tokens": 3})
    seen = []
    _recording(llm, seen)
    llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 6
    head = load_eagle3(head_path, target, torch.float32, CPU, TORCH_BACKEND)
    vocab = set(head.draft_to_target.tolist())
    for tokens, c, k, drafts, _ in seen[:12]:
        assert set(drafts) <= vocab
        with torch.no_grad():
            _, aux = hf_aux_states(hf, torch.tensor([tokens[:c + 1]]), LAYERS)
        want = dense_drafts(head, torch.tensor(tokens[:c + 1]), aux[0], k)[c - 1].tolist()
        assert drafts == want, f"at {c} computed tokens"


def test_engine_tree_nodes_are_the_dense_heads_top_candidates(target_path, head_path, target, hf, prompts):
    from specdec.spec_decode import tree

    topk = 3
    llm = LLM(model=target_path, **ENGINE, speculative_config={
        "method": "eagle3", "model": head_path, "num_speculative_tokens": 3, "tree_topk": topk, "tree_nodes": 8})
    seen = []
    _recording(llm, seen)
    llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 4 and any(len(d) > 3 for _, _, _, d, _ in seen)
    head = load_eagle3(head_path, target, torch.float32, CPU, TORCH_BACKEND)
    with torch.no_grad():
        for tokens, c, _, drafts, parents in seen[:6]:
            _, aux = hf_aux_states(hf, torch.tensor([tokens[:c]]), LAYERS)
            for i, parent in enumerate(parents):
                steps = DenseSteps(head, 1, c)
                out = steps.step(torch.tensor([tokens[1:c + 1]]), head.combine(aux))
                for a in tree.path_to(parents, parent) if parent >= 0 else []:
                    out = steps.step(torch.full((1, c), drafts[a]), out)
                top = head.compute_logits(out[0, -1:])[0].topk(topk).indices.tolist()
                assert drafts[i] in top, f"node {i} of {parents}"


@pytest.mark.parametrize("tree", [{}, {"tree_topk": 3, "tree_nodes": 8}], ids=["chain", "tree"])
def test_greedy_identical_with_eagle3_in_mixed_batches(target_path, head_path, prompts, tree):
    plain = LLM(model=target_path, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(model=target_path, **ENGINE, speculative_config={"method": "eagle3", "model": head_path,
                                                               "num_speculative_tokens": 3, **tree})
    params = [greedy if i % 3 else SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert len(o.outputs[0].token_ids) == 20
        if i % 3:
            assert o.outputs[0].token_ids == w, f"prompt {i} diverged"
    metrics = llm.get_metrics()
    assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0
    assert llm.engine.executor.driver_worker.num_request_states() == 0  # finished requests leave nothing behind
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_a_speculators_folder_alone_sets_method_and_k(target_path, head_path, tmp_path, llama_path):
    llm = LLM(model=target_path, **ENGINE, speculative_config={"model": head_path})
    spec = llm.engine.config.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("eagle3", 3)
    llm = LLM(model=target_path, **ENGINE, speculative_config={"model": head_path, "num_speculative_tokens": 2})
    assert llm.engine.config.speculative_config.num_speculative_tokens == 2  # what the user says wins
    with pytest.raises(ValueError, match="not a speculators EAGLE-3 checkpoint"):
        LLM(model=target_path, **ENGINE, speculative_config={"method": "eagle3", "model": llama_path})
    with pytest.raises(ValueError, match="use method 'eagle3'"):
        LLM(model=target_path, **ENGINE, speculative_config={"method": "eagle", "model": head_path})
    with pytest.raises(ValueError, match="outside the target's"):  # the 2-layer target has no layer 3
        LLM(model=llama_path, **ENGINE, speculative_config={"model": head_path})
