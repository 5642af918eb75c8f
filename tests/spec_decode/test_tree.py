"""Token trees (float32): the tree helpers, attention under tree masks against a dense
computation, the tree verifier (greedy walk; sampling reproduces the target's distribution),
and end to end: greedy output with tree drafting is token-identical to plain decoding, the
draft's tree is what the draft model itself ranks highest, logprobs and penalties behave as
without trees (preemption: ``test_spec_decode``), and no KV block leaks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.layers.attention import (
    AttentionMetadata,
    paged_attention_reference,
    paged_attention_torch,
)
from specdec.layers.sampler import SamplingMetadata
from specdec.spec_decode import tree

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128)
#        0   1   2   3   4   5
PARENTS = [-1, -1, 0, 0, 2, 1]  # root -> {0, 1}; 0 -> {2, 3}; 2 -> {4}; 1 -> {5}
TOKENS = [10, 11, 12, 13, 14, 15]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)


def tree_llm(target: str, draft: str, k: int = 3, topk: int = 3, nodes: int = 7, method: str = "draft_model",
             **kw) -> LLM:
    return LLM(model=target, **{**ENGINE, **kw}, speculative_config={
        "method": method, "model": draft, "num_speculative_tokens": k, "tree_topk": topk, "tree_nodes": nodes})


def test_tree_shape_helpers():
    assert tree.depths(PARENTS) == [1, 1, 2, 2, 3, 2]
    assert tree.path_to(PARENTS, 4) == [0, 2, 4]
    mask = tree.ancestor_mask(PARENTS)
    assert mask.shape == (7, 6) and not mask[0].any()
    assert mask[1 + 4].nonzero().flatten().tolist() == [0, 2, 4]
    assert mask[1 + 5].nonzero().flatten().tolist() == [1, 5]
    assert tree.row_histories(TOKENS, PARENTS) == [[], [10], [11], [10, 12], [10, 13], [10, 12, 14], [11, 15]]


def test_config_validates_tree_fields():
    with pytest.raises(ValueError, match="tree_topk must be in 1..8"):
        SpeculativeConfig(method="eagle", model="x", tree_topk=0)
    with pytest.raises(ValueError, match="tree_nodes must be in 1..64"):
        SpeculativeConfig(method="eagle", model="x", tree_topk=2, tree_nodes=100)
    with pytest.raises(ValueError, match="needs method 'draft_model', 'eagle', 'eagle3' or 'mtp'"):
        SpeculativeConfig(method="ngram", tree_topk=2)
    auto = SpeculativeConfig(method="eagle", model="x", tree_topk=2, num_speculative_tokens="auto",
                             max_num_speculative_tokens=6)
    assert auto.num_tree_nodes == 18 and auto.num_spec_slots == 18
    spec = SpeculativeConfig(method="eagle", model="x", num_speculative_tokens=5, tree_topk=4)
    assert spec.num_tree_nodes == 15 and spec.num_spec_slots == 16  # 4 nodes fed at each of depths 1..4


@pytest.mark.parametrize("attend", [paged_attention_reference, paged_attention_torch], ids=["reference", "torch"])
def test_tree_attention_sees_the_context_and_the_ancestors_only(attend):
    """Request 0 verifies the tree after 9 context tokens (its root row and 6 node rows);
    request 1, a plain 3-row causal chunk, shares the call. Node rows must equal attention over
    [context, ancestors, self] computed densely."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    cache = torch.randn(2, 12, bs, kv_heads, dim)
    tables = [[5, 2, 9, 0], [7, 3, 1, 0]]
    ctx, n = 9, len(PARENTS)
    seq0, seq1 = ctx + n, 7
    query = torch.randn(1 + n + 3, heads, dim)
    meta = AttentionMetadata(torch.tensor([0, 1 + n, 1 + n + 3]), torch.tensor([seq0, seq1]), torch.tensor(tables),
                             torch.zeros(1 + n + 3, dtype=torch.int64), [0, 1 + n, 1 + n + 3], [seq0, seq1], bs,
                             [(ctx, tree.ancestor_mask(PARENTS)), None])
    out = attend(query, cache, meta, 0.3)

    def keys(r, positions):
        slots = [tables[r][p // bs] * bs + p % bs for p in positions]
        flat = cache.view(2, -1, kv_heads, dim)
        return flat[0, slots].repeat_interleave(2, dim=1), flat[1, slots].repeat_interleave(2, dim=1)

    def dense(q, r, positions):
        k, v = keys(r, positions)  # [L, H, D]
        w = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * 0.3, dim=-1)
        return torch.einsum("hl,lhd->hd", w, v)

    context = list(range(ctx))
    # root row (the newest real token, at position ctx - 1): the context only
    torch.testing.assert_close(out[0], dense(query[0], 0, context), rtol=1e-5, atol=1e-5)
    for i in range(n):
        seen = context + [ctx + a for a in tree.path_to(PARENTS, i)]
        torch.testing.assert_close(out[1 + i], dense(query[1 + i], 0, seen), rtol=1e-5, atol=1e-5)
    for j in range(3):  # request 1: bottom-right causal as usual
        torch.testing.assert_close(out[1 + n + j], dense(query[1 + n + j], 1, list(range(seq1 - 3 + j + 1))),
                                   rtol=1e-5, atol=1e-5)


def _meta(temperatures: list[float], seeds: list[int | None]) -> SamplingMetadata:
    params = [SamplingParams(temperature=t, seed=s) for t, s in zip(temperatures, seeds)]
    gens = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
    return SamplingMetadata.from_params(params, gens, torch.device("cpu"))


def test_greedy_tree_walk_follows_the_target_argmax():
    v = 20
    logits = torch.full((1 + len(PARENTS), v), -5.0)
    # root row picks 10 (node 0), node 0 picks 12 (node 2), node 2 picks 7: no child 7 -> recovered
    logits[0, 10] = logits[1 + 0, 12] = logits[1 + 2, 7] = 5.0
    (verdict,) = tree.verify_trees(logits, [(TOKENS, PARENTS)], _meta([0.0], [None]))
    assert verdict.path == [0, 2] and verdict.tokens == [10, 12, 7] and verdict.rows == [0, 1, 3]
    logits[1 + 2, 7], logits[1 + 2, 14], logits[1 + 4, 3] = -5.0, 5.0, 5.0  # to the leaf 4, then its bonus
    (verdict,) = tree.verify_trees(logits, [(TOKENS, PARENTS)], _meta([0.0], [None]))
    assert verdict.path == [0, 2, 4] and verdict.tokens == [10, 12, 14, 3] and verdict.rows == [0, 1, 3, 5]
    logits[0, 10], logits[0, 9] = -5.0, 5.0  # no root child matches: one token, no draft kept
    plain_row = torch.zeros(1, v)
    plain_row[0, 4] = 1.0  # a request without drafts next to it: its one row decides
    verdicts = tree.verify_trees(torch.cat([logits, plain_row]), [(TOKENS, PARENTS), ([], [])],
                                 _meta([0.0, 0.0], [None, None]))
    assert (verdicts[0].path, verdicts[0].tokens) == ([], [9]) and (verdicts[1].path, verdicts[1].tokens) == ([], [4])


def test_sampled_tree_walk_reproduces_the_target_distribution():
    """Two emitted tokens per verification, from a 6-token vocabulary whose drafts cover the
    likely and unlikely tokens. N = 20,000 seeded draws; Pearson chi-square of the joint
    (token 1, token 2) counts against p1(x) p2(y | x) (the tree's rows), significance 1e-3,
    cells with expected count < 5 merged; negative control: the same counts against the root
    row's distribution sharpened (temperature 0.85) must be rejected."""
    v = 6
    parents = [-1, -1, -1, 0, 0, 1]  # root -> {0: tok 2, 1: tok 0, 2: tok 5}; 0 -> {3: tok 1, 4: tok 2}; 1 -> {5: tok 3}
    tokens = [2, 0, 5, 1, 2, 3]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1 + len(parents), v, generator=gen) * 1.5
    rows_for_first = {2: 1 + 0, 0: 1 + 1, 5: 1 + 2}  # the row that scores token 2 when token 1 was a drafted child
    num = 20_000
    counts = np.zeros((v, v))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(num)]
    gens = [torch.Generator().manual_seed(i) for i in range(num)]
    meta = SamplingMetadata.from_params(params, gens, torch.device("cpu"))
    verdicts = tree.verify_trees(logits.repeat(num, 1), [(tokens, parents)] * num, meta)
    for verdict in verdicts:
        if len(verdict.tokens) >= 2:
            counts[verdict.tokens[0], verdict.tokens[1]] += 1
    # the second token exists exactly when the first was a drafted child
    p = torch.softmax(logits.double(), dim=-1).numpy()
    joint = np.zeros((v, v))
    for first, row in rows_for_first.items():
        joint[first] = p[0, first] * p[row]
    assert counts.sum() == pytest.approx(num * joint.sum(), rel=0.03)

    def p_value(probs):
        possible = probs.ravel() > 0  # (a first token no row drafts has no second token)
        assert counts.ravel()[~possible].sum() == 0
        expected, observed = probs.ravel()[possible] / probs.sum() * counts.sum(), counts.ravel()[possible]
        big = expected >= 5
        if big.all():
            return chisquare(observed, expected).pvalue
        return chisquare(np.append(observed[big], observed[~big].sum()),
                         np.append(expected[big], expected[~big].sum())).pvalue

    assert p_value(joint) > 1e-3
    sharp = torch.softmax(logits.double() / 0.85, dim=-1).numpy()
    wrong = np.zeros((v, v))
    for first, row in rows_for_first.items():
        wrong[first] = sharp[0, first] * p[row]
    assert p_value(wrong) < 1e-3


def test_seeded_tree_verification_repeats():
    logits = torch.randn(1 + len(PARENTS), 20, generator=torch.Generator().manual_seed(0))
    runs = [tree.verify_trees(logits, [(TOKENS, PARENTS)], _meta([0.7], [42]))[0].tokens for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.fixture(scope="module")
def reference(llama_path, prompts) -> dict[str, list[int]]:
    outs = LLM(model=llama_path, **ENGINE).generate(prompts, greedy(), use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(prompts, outs)}


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.has_unfinished_requests() and not engine.kv.req_blocks


@pytest.mark.parametrize("k, topk, nodes", [(3, 2, 5), (4, 3, 10), (2, 4, 8)])
def test_greedy_is_identical_with_tree_drafts_in_mixed_batches(k, topk, nodes, llama_path, noisy_draft_path, prompts,
                                                               reference):
    llm = tree_llm(llama_path, noisy_draft_path, k, topk, nodes)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24, ignore_eos=True)
    batch = [(p, greedy(), True) for p in prompts]
    for i in range(4):
        batch.insert(3 * i + 1, (prompts[i], sampled, False))
        batch.insert(3 * i + 2, (prompts[-1 - i], greedy(use_speculation=False), True))
    outs = llm.generate([p for p, _, _ in batch], [sp for _, sp, _ in batch], use_tqdm=False)
    for (prompt, _, is_greedy), out in zip(batch, outs):
        assert len(out.outputs[0].token_ids) == 24
        if is_greedy:
            assert out.outputs[0].token_ids == reference[prompt], f"{prompt!r} diverged (k={k}, topk={topk})"
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and 0 < m["num_accepted_tokens"] and max(m["k_histogram"]) <= k
    assert m["num_draft_tokens"] / m["num_drafts"] > k  # trees, not chains: more nodes than depth
    assert_no_leaks(llm)


def test_tree_nodes_are_the_draft_models_own_top_candidates(llama_path, noisy_draft_path, prompts):
    """Every node of every proposed tree is among the top-k next tokens the draft model (run
    densely by transformers on prompt + output + the node's ancestors) gives its parent."""
    from transformers import AutoModelForCausalLM

    topk = 3
    llm = tree_llm(llama_path, noisy_draft_path, 3, topk, 9)
    seen = []
    inner = llm.engine.executor.driver_worker.proposer.propose

    def recording(requests, num_spec, tree_budget=None, **kw):
        before = [list(r.all_token_ids) for r in requests]
        proposal = inner(requests, num_spec, tree_budget, **kw)
        seen.extend((b, d, p) for b, d, p in zip(before, proposal.draft_token_ids, proposal.draft_parents) if d)
        return proposal

    llm.engine.executor.driver_worker.proposer.propose = recording
    llm.generate(prompts[:3], greedy(12), use_tqdm=False)
    assert len(seen) >= 6
    hf = AutoModelForCausalLM.from_pretrained(noisy_draft_path, dtype=torch.float32).eval()
    for tokens, drafts, parents in seen[:10]:
        for i, parent in enumerate(parents):
            before = tokens + [drafts[a] for a in tree.path_to(parents, parent)] if parent >= 0 else tokens
            with torch.no_grad():
                top = hf(torch.tensor([before])).logits[0, -1].topk(topk).indices.tolist()
            assert drafts[i] in top


def test_logprobs_and_penalties_with_trees(llama_path, noisy_draft_path, prompts, reference):
    params = [greedy(logprobs=2), greedy(repetition_penalty=1.3, frequency_penalty=0.3), greedy(min_tokens=8)]
    plain = LLM(model=llama_path, **ENGINE).generate(prompts[:6], params * 2, use_tqdm=False)
    spec = tree_llm(llama_path, noisy_draft_path, 4, 3, 10).generate(prompts[:6], params * 2, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for da, db in zip(plain[0].outputs[0].logprobs, spec[0].outputs[0].logprobs):
        assert da.keys() == db.keys() and all(abs(da[t] - db[t]) < 1e-4 for t in da)


def test_adaptive_trees_stay_greedy_identical_and_size_themselves(llama_path, noisy_draft_path, prompts, reference):
    """K "auto" with trees: the planner picks each request's depth, the cost model how many of
    the drafted nodes are verified (a varying number, within the ceiling)."""
    llm = LLM(model=llama_path, **ENGINE, speculative_config={
        "method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": "auto",
        "max_num_speculative_tokens": 4, "tree_topk": 3, "tree_nodes": 12})
    # a priced machine (tiny models' real timings are noise): a pass costs 20 ms + 0.5 ms per row,
    # a draft pass 1 ms, so deep trees pay for some nodes but not for all of them
    cost = llm.engine.spec_controller.cost
    cost.costs = lambda kind, n, num_requests=None: np.where(np.asarray(n, dtype=float) > 0,
                                          0.02 + 0.0005 * np.asarray(n, dtype=float) if kind == "target" else 0.001, 0.0)
    cost.observe = lambda *args: None
    sizes = []
    inner = llm.engine.executor.driver_worker.proposer.propose

    def recording(requests, num_spec, tree_budget=None, **kw):
        proposal = inner(requests, num_spec, tree_budget, **kw)
        sizes.extend(len(d) for d, k in zip(proposal.draft_token_ids, num_spec) if k)
        assert proposal.expected_accepted is not None
        return proposal

    llm.engine.executor.driver_worker.proposer.propose = recording
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in prompts]
    assert sizes and max(sizes) <= 12 and len(set(sizes)) > 1
    assert llm.get_metrics()["num_accepted_tokens"] > 0 and llm.engine.spec_controller.tree_calibration != 1.0
    assert_no_leaks(llm)
