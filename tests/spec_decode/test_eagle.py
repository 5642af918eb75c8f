"""EAGLE head and proposer (float32): the paged head equals its dense reference, the engine's
drafts are exactly what the head computes from the target's own hidden states, and greedy
output with EAGLE speculation is token-identical to plain decoding."""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.layers.attention import TORCH_BACKEND
from specdec.models.eagle import dense_forward, load_head, save_head
from specdec.models.loader import load_model
from specdec.worker.model_runner import ModelRunner

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128)


@pytest.fixture(scope="module")
def target(llama_path):
    return load_model(llama_path, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def head_path(eagle_head_path) -> str:
    return eagle_head_path


def test_paged_head_matches_dense_reference(target, head_path):
    head = load_head(head_path, target, torch.float32, torch.device("cpu"), TORCH_BACKEND)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (1, 21))
    feats = torch.randn(1, 21, target.config.hidden_size)
    want = dense_forward(head, ids, feats)[0]
    runner = ModelRunner(head, num_blocks=8, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    table = [3, 1, 7, 0, 2, 5]
    got = []
    for lo, hi in [(0, 13), (13, 14), (14, 21)]:  # a prompt, one decode row, a catch-up run
        batch = runner.prepare([ids[0, lo:hi].tolist()], [lo], [table], [list(range(hi - lo))])
        batch.features = feats[0, lo:hi]
        got.append(runner.forward_with_hidden(batch)[1])
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


def test_paged_head_over_a_token_tree_matches_dense_paths(target, head_path):
    """A tree pass of the head (nodes at their depth's position, in their own slots, each
    seeing the context and its ancestors) gives every node the hidden state the dense head
    computes over the context followed by the node's path."""
    from specdec.spec_decode import tree

    head = load_head(head_path, target, torch.float32, torch.device("cpu"), TORCH_BACKEND)
    torch.manual_seed(0)
    ctx = 11
    ids = torch.randint(0, 300, (ctx,)).tolist()
    feats = torch.randn(ctx + 5, target.config.hidden_size)  # context features, then one per fed node
    parents = [-1, -1, -1, 0, 2]  # depth 1: nodes 0, 1, 2; depth 2: 3 (under 0), 4 (under 2)
    node_ids = [301, 17, 99, 5, 250]
    runner = ModelRunner(head, num_blocks=8, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    table = [6, 2, 0, 7, 4, 1]
    batch = runner.prepare([ids], [0], [table], [[ctx - 1]])
    batch.features = feats[:ctx]
    runner.forward(batch)
    got = {}
    for nodes, fed_before in (([0, 1, 2], 0), ([3, 4], 3)):
        depth = tree.depths(parents)[nodes[0]]
        fed = list(range(fed_before + len(nodes)))  # nodes 0..4 are fed in order: node n sits in slot ctx + n
        mask = torch.tensor([[a in tree.path_to(parents, n) for a in fed] for n in nodes])
        batch = runner.prepare([[node_ids[n] for n in nodes]], [ctx + fed_before], [table], [list(range(len(nodes)))],
                               [[ctx + depth - 1] * len(nodes)], [(ctx, mask)])
        batch.features = feats[[ctx + n for n in nodes]]
        got.update(zip(nodes, runner.forward_with_hidden(batch)[1]))
    for n in range(len(parents)):
        path = tree.path_to(parents, n)
        want = dense_forward(head, torch.tensor([ids + [node_ids[a] for a in path]]),
                             torch.cat([feats[:ctx], feats[[ctx + a for a in path]]])[None])[0, -1]
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-4)


def test_roundtrip_and_bad_folder(target, head_path, llama_path):
    head = load_head(head_path, target, torch.float32, torch.device("cpu"), TORCH_BACKEND)
    assert sum(p.numel() for p in head.parameters()) < sum(p.numel() for p in target.parameters())
    with pytest.raises(ValueError, match="not an EAGLE head"):
        LLM(model=llama_path, **ENGINE, speculative_config={"method": "eagle", "model": llama_path})
    with pytest.raises(ValueError, match="required for method 'eagle'"):
        LLM(model=llama_path, **ENGINE, speculative_config={"method": "eagle"})


def reference_drafts(hf, head, tokens: list[int], num_computed: int, k: int) -> list[int]:
    """Greedy drafts from the dense head (``dense_chain``) fed the target's (transformers') hidden states."""
    from specdec.training.train_eagle import dense_chain

    with torch.no_grad():
        feats = hf.model(torch.tensor([tokens[:num_computed]])).last_hidden_state[0]  # f_0 .. f_{c-1}
    return dense_chain(head, feats, tokens, num_computed, k)


def test_engine_drafts_equal_dense_head_on_target_features(llama_path, head_path, target, prompts):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=llama_path, **ENGINE, speculative_config={"method": "eagle", "model": head_path,
                                                              "num_speculative_tokens": 3})
    proposer = llm.engine.executor.driver_worker.proposer
    seen = []
    inner = proposer.propose

    def recording(requests, num_spec, tree_budget=None, **kw):
        snapshot = [(list(r.all_token_ids), r.num_computed_tokens, k) for r, k in zip(requests, num_spec)]
        proposal = inner(requests, num_spec, tree_budget, **kw)
        seen.extend((toks, c, k, d) for (toks, c, k), d in zip(snapshot, proposal.draft_token_ids) if k)
        return proposal

    proposer.propose = recording
    llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 6
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    head = load_head(head_path, target, torch.float32, torch.device("cpu"), TORCH_BACKEND)
    for toks, c, k, drafts in seen[:12]:
        assert drafts == reference_drafts(hf, head, toks, c, k), f"at {c} computed tokens"


def test_greedy_identical_with_eagle_in_mixed_batches(llama_path, head_path, prompts):
    plain = LLM(model=llama_path, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(model=llama_path, **ENGINE, speculative_config={"method": "eagle", "model": head_path,
                                                              "num_speculative_tokens": 2})
    params = [greedy if i % 3 else SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert len(o.outputs[0].token_ids) == 20
        if i % 3:
            assert o.outputs[0].token_ids == w, f"prompt {i} diverged"
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert llm.engine.executor.driver_worker.num_request_states() == 0  # finished requests leave nothing behind
    engine = llm.engine
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_draft_vocabulary_restricts_drafts_and_stays_lossless(llama_path, target, head_path, tmp_path, prompts):
    head = load_head(head_path, target, torch.float32, torch.device("cpu"), TORCH_BACKEND)
    vocab = torch.arange(0, 320, 2)  # even token ids only
    head.set_draft_vocab(vocab)
    logits = head.compute_logits(torch.randn(5, target.config.hidden_size))
    assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, 0::2]).all()
    save_head(head, tmp_path / "head")
    llm = LLM(model=llama_path, **ENGINE, speculative_config={"method": "eagle", "model": str(tmp_path / "head"),
                                                              "num_speculative_tokens": 3})
    proposals = []
    inner = llm.engine.executor.driver_worker.proposer.propose
    llm.engine.executor.driver_worker.proposer.propose = lambda r, k, b=None, **kw: proposals.append(inner(r, k, b, **kw)) or proposals[-1]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in LLM(model=llama_path, **ENGINE).generate(prompts[:4], params, use_tqdm=False)]
    assert got == want
    drafted = [t for p in proposals for d in p.draft_token_ids for t in d]
    assert drafted and all(t % 2 == 0 for t in drafted)


def test_eagle_tree_nodes_are_the_dense_heads_top_candidates_and_greedy_stays_identical(llama_path, head_path, target,
                                                                                       prompts):
    """Tree drafting with the head: each node is among the top-k tokens the dense head gives
    its parent when fed the target's features, then its own predicted features along the
    node's ancestors; greedy output equals plain decoding."""
    from transformers import AutoModelForCausalLM

    from specdec.spec_decode import tree

    topk = 3
    llm = LLM(model=llama_path, **ENGINE, speculative_config={
        "method": "eagle", "model": head_path, "num_speculative_tokens": 3, "tree_topk": topk, "tree_nodes": 8})
    seen = []
    inner = llm.engine.executor.driver_worker.proposer.propose

    def recording(requests, num_spec, tree_budget=None, **kw):
        snapshot = [(list(r.all_token_ids), r.num_computed_tokens) for r in requests]
        proposal = inner(requests, num_spec, tree_budget, **kw)
        seen.extend((t, c, d, p) for (t, c), d, p in zip(snapshot, proposal.draft_token_ids,
                                                          proposal.draft_parents or [None] * len(requests)) if d)
        return proposal

    llm.engine.executor.driver_worker.proposer.propose = recording
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in LLM(model=llama_path, **ENGINE).generate(prompts[:4], params, use_tqdm=False)]
    assert got == want
    assert len(seen) >= 6 and any(len(d) > 3 for _, _, d, _ in seen)
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    head = load_head(head_path, target, torch.float32, torch.device("cpu"), TORCH_BACKEND)
    with torch.no_grad():
        for tokens, c, drafts, parents in seen[:8]:
            feats = hf.model(torch.tensor([tokens[:c]])).last_hidden_state[0]  # f_0 .. f_{c-1}
            for i, parent in enumerate(parents):
                ids, rows = list(tokens[1:c + 1]), feats
                for a in (tree.path_to(parents, parent) if parent >= 0 else []) + [None]:
                    pred = dense_forward(head, torch.tensor([ids]), rows[None])[0, -1]
                    if a is not None:  # feed the ancestor with the feature its parent's row predicted
                        ids.append(drafts[a])
                        rows = torch.cat([rows, pred[None]])
                top = head.compute_logits(pred[None])[0].topk(topk).indices.tolist()
                assert drafts[i] in top, f"node {i} of {parents}"
