"""``specdec train-draft --arch eagle3``: train an EAGLE-3 head (``models/eagle3.py``) for a target and
write it in the speculators format (``models/speculators.py``), which vLLM loads too.

Same corpus and resumable phases as the other architectures (``train_draft.py``); what differs:

2. teacher ``eagle3_teacher/*.pt``  one bf16 forward of the target per chunk keeps the inputs of
   the auxiliary layers (low, middle, high: ``default_aux_layer_ids``; the head's input, bf16) and
   the top-k of the target's next-token distribution renormalised over the draft vocabulary (the
   ``draft_vocab_size`` most frequent corpus tokens; what the head's LM head can say).
3. train   training-time test over ``ttt_steps`` steps (``DenseSteps``): step 0 reads the target's
   features, step j the head's own step-(j-1) outputs, every row attending to what it would attend
   to while drafting; tokens are the corpus's (teacher forcing, as speculators trains). Loss: top-k
   + rest KL to the target at each step, step j weighted 0.8^j. The LM head is the target's rows of
   the draft vocabulary, frozen; the embedding is the target's (not saved).
4. eval    the engine's greedy chain replayed on held-out target answers (``dense_drafts``): mean
   acceptance length at K = 5, and how often each draft position is accepted.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specdec.models.eagle3 import Eagle3Head, Eagle3Options
from specdec.models.eagle3_dense import DenseSteps, dense_drafts, hf_aux_states
from specdec.models.speculators import default_aux_layer_ids, save_eagle3
from specdec.training.train_draft import (
    fingerprint,
    prepare_run,
    train,
)
from specdec.training.train_eagle import (
    cache_sharded,
    frequent_tokens,
    frozen_head_kl,
    replay_report,
)

STEP_DECAY = 0.8


def init_eagle3(target, aux_layer_ids=None, draft_vocab: torch.Tensor | None = None, num_layers: int = 1,
                intermediate_size: int | None = None, seed: int = 0) -> Eagle3Head:
    """A fresh head for ``target`` (float32, on the target's device): small random weights, norms at
    one, the LM head the target's rows of ``draft_vocab`` (default: the whole vocabulary)."""
    from specdec.layers.attention import TORCH_BACKEND
    from specdec.models.eagle import head_config

    config = head_config(target.config, intermediate_size)
    config.num_hidden_layers = num_layers
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(target.config.num_hidden_layers)
    vocab = torch.arange(target.config.vocab_size) if draft_vocab is None else draft_vocab.to(torch.long).cpu()
    options = Eagle3Options(ids, target.config.hidden_size, len(vocab))
    head = Eagle3Head(config, options, TORCH_BACKEND)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.02)
        head.lm_head.weight.copy_(target.lm_head.weight.detach().float().cpu()[vocab])
    head.set_draft_vocab(None if draft_vocab is None else vocab)
    head.rotary.reset_tables()
    head.attach(target)
    return head.to(next(target.parameters()).device)


def cache_features(teacher, chunks: torch.Tensor, vocab: torch.Tensor, layer_ids, cfg, shard_dir: Path):
    """-> aux features [N, S, n * H] bf16, draft-vocab top-k ids [N, S, k] int32 and log-probs
    [N, S, k] fp32 (over the draft vocabulary), in shards a killed run keeps."""
    cols = vocab.to(teacher.device)

    def batch(rows):
        logits, aux = hf_aux_states(teacher, rows.to(teacher.device), layer_ids)
        return aux, logits[..., cols]

    return cache_sharded(chunks, cfg, shard_dir, (fingerprint(vocab), tuple(layer_ids)), batch)


def _step_kl(head, out, topk_ids, topk_logp, num_negatives: int, generator) -> torch.Tensor:
    """KL(target top-k + rest || head) over the draft vocabulary; out [B, R, H], topk_* [B, R, k]."""
    hidden = (out if head.options.norm_output else head.norm(out)).float().flatten(0, 1)
    return frozen_head_kl(head.lm_head.weight.detach(), hidden, topk_ids, topk_logp, num_negatives, generator)


def eagle3_loss(head, ids, aux, topk_ids, topk_logp, cfg, generator):
    """ids [B, S]; aux [B, S, n * H] (the target's); topk_* [B, S, k] (draft-vocab top-k of the
    target's distribution of the token after each position) -> (loss, log extras). Row i of step j
    reads token i + 1 + j and predicts token i + 2 + j, scored against the target at i + 1 + j."""
    b, s = ids.shape
    device = ids.device
    steps = DenseSteps(head, b, s - 1)
    loss, extra = 0.0, {}
    with torch.autocast(device.type, dtype=torch.bfloat16):
        hidden = head.combine(aux[:, :-1].float())
    for j in range(cfg.ttt_steps):
        feed = torch.cat([ids[:, 1 + j:], ids.new_zeros(b, j)], dim=1)     # rows past the end: padding
        with torch.autocast(device.type, dtype=torch.bfloat16):
            hidden = steps.step(feed, hidden)
        rows = s - 1 - j                                                   # rows with a target token
        kl = _step_kl(head, hidden[:, :rows], topk_ids[:, 1 + j:], topk_logp[:, 1 + j:], cfg.num_negatives, generator)
        loss = loss + STEP_DECAY ** j * kl
        extra[f"kl{j + 1}"] = round(kl.item(), 4)
    return loss, extra


@torch.inference_mode()
def evaluate_eagle3(head, teacher, items: list[dict], k: int = 5) -> dict:
    """Per domain: top-1 agreement of the head's first draft with the target (teacher-forced) and,
    on greedy target answers, the replayed chain: mean acceptance length at K = k and the share
    of steps accepting each draft position."""
    report: dict[str, dict] = {}
    layer_ids = head.options.aux_layer_ids
    for item in items:
        tokens = torch.tensor(item["ids"], device=teacher.device)
        logits, aux = hf_aux_states(teacher, tokens[None], layer_ids)
        target_next = logits[0].argmax(-1).tolist()                      # the token after each position
        drafts = dense_drafts(head, tokens, aux[0].float(), k).tolist()   # row c - 1: drafts at c computed
        r = report.setdefault(item["domain"], {"tokens": 0, "agree": 0, "steps": 0, "emitted": 0, "pos": [0] * k})
        lo = max(item["start"] - 1, 1)
        agree = [drafts[p - 1][0] == target_next[p] for p in range(lo, len(target_next) - 1)]
        r["tokens"] += len(agree)
        r["agree"] += sum(agree)
        if item.get("greedy"):
            ids, c = item["ids"], item["start"]          # replay: c tokens computed, token c just sampled
            while c < len(ids) - 1:
                chain = drafts[c - 1][:min(k, len(ids) - 1 - c)]
                run = next((i for i, (d, t) in enumerate(zip(chain, ids[c + 1:])) if d != t), len(chain))
                for i in range(run):
                    r["pos"][i] += 1
                r["steps"] += 1
                r["emitted"] += run + 1
                c += run + 1
    return replay_report(report, k)


def train_eagle3(cfg) -> dict:
    from specdec.models.loader import load_model

    device, target_dir, work, out, _, teacher, data = prepare_run(cfg)
    stats, chunks = cfg.stats, data["chunks"]
    target = load_model(str(target_dir), torch.float32, device)     # the frozen embedding + LM head
    num_target = target.config.vocab_size
    vocab = torch.arange(num_target)
    if cfg.draft_vocab_size and cfg.draft_vocab_size < num_target:
        vocab, coverage = frequent_tokens(chunks, cfg.draft_vocab_size, num_target)
        stats["draft_vocab_size"], stats["draft_vocab_corpus_coverage"] = len(vocab), round(coverage, 4)
    layer_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    t = time.time()
    feats, topk_ids, topk_logp = cache_features(teacher, chunks, vocab, layer_ids, cfg, work / "eagle3_teacher")
    stats["teacher_s"] = round(time.time() - t, 1)

    head = init_eagle3(target, layer_ids, vocab if len(vocab) < num_target else None, seed=cfg.seed).to(device)
    head.lm_head.weight.requires_grad_(False)

    def loss_fn(idx, generator):
        return eagle3_loss(head, chunks[idx].to(device), feats[idx].to(device), topk_ids[idx].to(device),
                           topk_logp[idx].to(device), cfg, generator)

    architectures = json.loads((Path(target_dir) / "config.json").read_text()).get("architectures") or []
    extra = {"specdec": {"target": str(cfg.target), "corpus_tokens": stats["corpus_tokens"],
                         "ttt_steps": cfg.ttt_steps}}

    def save(model):
        save_eagle3(model, out, str(cfg.target), architectures, cfg.ttt_steps, extra)

    t = time.time()
    log = train(head, chunks, cfg, save, loss_fn)
    stats["train_s"] = round(time.time() - t, 1)
    stats["train_total_s"] = log[-1]["elapsed_s"] if log else 0.0
    stats["final_train_loss"] = sum(r["kl_topk"] for r in log[-20:]) / max(1, len(log[-20:]))
    stats["final_kl1"] = sum(r.get("kl1", 0.0) for r in log[-20:]) / max(1, len(log[-20:]))

    t = time.time()
    head.eval()
    report = evaluate_eagle3(head, teacher.float(), data["eval"])
    stats["eval_s"] = round(time.time() - t, 1)
    report["_stats"] = stats
    (work / "eval.json").write_text(json.dumps(report, indent=1))
    return report
