"""Token trees: a draft that proposes several candidates per position, verified in one pass.

A chain drafts one token per position, so its first miss ends the step. A tree keeps the
draft's top few candidates at the positions where it is unsure (EAGLE-2, Li et al. 2024,
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees"; SpecInfer, Miao et
al. 2024): the target scores every node in one forward, each node attending only to its
ancestors (``AttentionMetadata.tree_masks``), and the longest path the target agrees with is
kept. A tree is stored flat: ``tokens[i]`` with ``parents[i]`` (-1: the request's newest
token, the root), nodes in topological order (a parent before its children) and siblings
in the order they are tried.

Verification is lossless for any sampling parameters. At a node whose target distribution is
p, its children c_1, c_2, ... are tried in order: c_i is accepted with probability
r(c_i) / sum(r), where r is p with the children already rejected set to zero; if every child
is rejected the token is drawn from r. Each token is then emitted with probability exactly
p(token) (sequential sampling without replacement), which needs no draft probabilities: the
tree's children are the draft's deterministic top-k, not samples. Greedy requests follow the
child equal to the target's argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.layers.sampler import SamplingMetadata, processed_probs, sample_from_probs


@dataclass
class TreeVerdict:
    path: list[int]  # accepted nodes, root to leaf (indices into the request's tree)
    tokens: list[int]  # the path's tokens, then the recovered or bonus token
    rows: list[int]  # the target row (within the request) each emitted token was scored by


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (1 for the root's children)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: list[int], rows_before: int = 1) -> torch.Tensor:
    """[rows_before + n, n] bool: row rows_before + i sees node i and its ancestors; the first
    ``rows_before`` rows (the fed real tokens, the root last) see no node."""
    n = len(parents)
    mask = torch.zeros(rows_before + n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[rows_before + i] = mask[rows_before + p]
        mask[rows_before + i, i] = True
    return mask


def path_to(parents: list[int], node: int) -> list[int]:
    """Nodes from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def row_histories(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Per target row (root, then each node): the draft tokens before the position it scores."""
    return [[]] + [[tokens[a] for a in path_to(parents, i)] for i in range(len(tokens))]


def _children(parents: list[int]) -> list[list[int]]:
    """children[0] = the root's, children[1 + i] = node i's, in node order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def verify_trees(
    target_logits: torch.Tensor,  # [sum(1 + n_r), V] float32, penalties applied; request r's root row first
    trees: list[tuple[list[int], list[int]]],  # per request: (tokens, parents); ([], []) => plain decoding
    meta: SamplingMetadata,  # one row per request
) -> list[TreeVerdict]:
    """Walk each request's tree against the target (module docstring). A seeded request draws
    from its own generator, one uniform per child tried and one draw for its last token."""
    num_rows = [1 + len(t) for t, _ in trees]
    if target_logits.shape[0] != sum(num_rows):
        raise ValueError(f"verify_trees: trees of {[n - 1 for n in num_rows]} nodes need {sum(num_rows)} target "
                         f"rows, got {target_logits.shape[0]}")
    greedy = (meta.temperature == 0).tolist()
    argmax = target_logits.argmax(dim=-1).tolist()
    probs = None
    if not all(greedy):
        probs = processed_probs(target_logits, meta.expand(num_rows))
    verdicts: list[TreeVerdict] = []
    residuals: dict[int, torch.Tensor] = {}  # random requests: the distribution their last token is drawn from
    first_row = 0
    for r, (tokens, parents) in enumerate(trees):
        children = _children(parents)
        path: list[int] = []
        rows = [0]  # emitted token j is scored by the row of path[j - 1] (the root row for j = 0)
        node, final = -1, -1
        while True:
            row = first_row + rows[-1]
            kids = children[node + 1]
            if greedy[r]:
                nxt = next((c for c in kids if tokens[c] == argmax[row]), None)
                if nxt is None:
                    final = argmax[row]
            else:
                nxt, rejected = _try_children(probs[row], [tokens[c] for c in kids], meta.generators[r])
                if nxt is None:
                    residuals[r] = _without(probs[row], rejected)
                else:
                    nxt = kids[nxt]
            if nxt is None:
                break
            path.append(nxt)
            rows.append(1 + nxt)
            node = nxt
        verdicts.append(TreeVerdict(path, [tokens[c] for c in path] + [final], rows))
        first_row += num_rows[r]
    if residuals:  # one draw per random request, each from its own generator after its uniforms
        order = sorted(residuals)
        drawn = sample_from_probs(torch.stack([residuals[r] for r in order]),
                                  meta.expand([int(r in residuals) for r in range(len(trees))])).tolist()
        for r, token in zip(order, drawn):
            verdicts[r].tokens[-1] = token
    return verdicts


def _try_children(p: torch.Tensor, candidates: list[int], generator) -> tuple[int | None, list[int]]:
    """Accept candidate i with probability r(c_i) / sum(r), r = p without the candidates
    rejected before it: (index accepted or None, tokens rejected)."""
    if not candidates:
        return None, []
    p_of = p[torch.tensor(candidates, dtype=torch.int64, device=p.device)].tolist()
    uniforms = torch.rand(len(candidates), generator=generator, device=p.device).tolist()
    mass, rejected = 1.0, []
    for i, (token, pc, u) in enumerate(zip(candidates, p_of, uniforms)):
        if u * mass < pc:
            return i, rejected
        mass -= pc
        rejected.append(token)
    return None, rejected


def _without(p: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """p with ``tokens`` zeroed (left unnormalised; p itself if rounding emptied it)."""
    if not tokens:
        return p
    residual = p.clone()
    residual[torch.tensor(tokens, dtype=torch.int64, device=p.device)] = 0.0
    return residual if residual.sum() > 0 else p
