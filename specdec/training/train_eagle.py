"""``specdec train-draft --arch eagle``: train an EAGLE head (``models/eagle.py``) for a target.

Same corpus and resumable phases as the Llama draft (``train_draft.py``); what differs:

2. teacher ``eagle_teacher/*.pt``  one bf16 forward of the target per chunk keeps its final
   hidden states (the head's input and regression target, bf16) and its top-k log-probs.
3. train   row p reads (f_p + noise, token p + 1) and predicts f_{p+1}; loss = KL(target || head)
   at token p + 2 over the teacher's top-k plus "the rest" (through the target's frozen LM head)
   + ``feature_loss`` * smooth-L1(prediction, f_{p+1}). The noise (uniform, +-``feature_noise``
   of the features' std) stands in for the head's own errors, which it reads from pass 2 on.
   With ``unroll`` N, pass j = 2..N feeds pass j-1's predictions back as features and is scored
   against the target j-1 tokens further (what drafting position j sees), at weight 0.5^(j-1):
   the head learns to read its own errors, which is what decays the chain from position 2 on.
4. eval    replays greedy drafting on held-out target answers: at each step the head drafts K
   tokens from the target's real features (then its own predictions), the run of matches plus
   one is the step's length; reports mean acceptance length at K = 5 and top-1 agreement.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.models.eagle import dense_forward, init_head, save_head
from specdec.training.train_draft import (
    FusedHeadTopKRestKL,
    _save_atomic,
    fingerprint,
    prepare_run,
    train,
)

ROWS_PER_SHARD = 64


@torch.inference_mode()
def cache_sharded(chunks: torch.Tensor, cfg, shard_dir: Path, key_parts: tuple, teacher_batch):
    """Run ``teacher_batch(rows) -> (features, logits over the kept vocabulary)`` over ``chunks``
    and keep (features bf16, top-k ids int32, top-k log-probs fp32) in shards a killed run keeps;
    a shard is reused only when its rows and ``key_parts`` are unchanged."""
    from tqdm.auto import tqdm

    shard_dir.mkdir(parents=True, exist_ok=True)
    feats, ids, logps = [], [], []
    bar = tqdm(total=len(chunks), desc="target features", unit="chunk", disable=not cfg.progress, mininterval=5)
    for shard, start in enumerate(range(0, len(chunks), ROWS_PER_SHARD)):
        path = shard_dir / f"{shard:05d}.pt"
        rows = chunks[start:start + ROWS_PER_SHARD]
        key = (fingerprint(rows), *key_parts, cfg.top_k)
        part = torch.load(path) if path.exists() else None
        if part is None or part.get("key") != key:
            f_parts, i_parts, l_parts = [], [], []
            for s in range(0, len(rows), cfg.teacher_batch_size):
                features, logits = teacher_batch(rows[s:s + cfg.teacher_batch_size])
                values, top = logits.float().log_softmax(-1).topk(cfg.top_k, dim=-1)
                f_parts.append(features.to(torch.bfloat16).cpu())
                i_parts.append(top.int().cpu())
                l_parts.append(values.cpu())
            part = {"features": torch.cat(f_parts), "ids": torch.cat(i_parts), "logp": torch.cat(l_parts), "key": key}
            _save_atomic(part, path)
        feats.append(part["features"])
        ids.append(part["ids"])
        logps.append(part["logp"])
        bar.update(len(rows))
    bar.close()
    return torch.cat(feats), torch.cat(ids), torch.cat(logps)


def cache_features(teacher, chunks: torch.Tensor, cfg, shard_dir: Path):
    """-> features [N, S, H] bf16, top-k ids [N, S, k] int32, log-probs [N, S, k] fp32, in shards."""
    def batch(rows):
        hidden = teacher.model(rows.to(teacher.device)).last_hidden_state
        return hidden, teacher.lm_head(hidden)

    return cache_sharded(chunks, cfg, shard_dir, (), batch)


def _topk_kl(head, pred: torch.Tensor, topk_ids, topk_logp, num_negatives: int, generator) -> torch.Tensor:
    """KL(target top-k + rest || softmax(lm_head(pred))) with the target's LM head frozen."""
    return frozen_head_kl(head.target[0].lm_head.weight.detach(), pred.float().flatten(0, 1), topk_ids, topk_logp,
                          num_negatives, generator)


def frozen_head_kl(weight: torch.Tensor, hidden: torch.Tensor, topk_ids, topk_logp, num_negatives: int,
                   generator) -> torch.Tensor:
    """KL(target top-k + rest || softmax(hidden @ weight^T)); hidden [N, H] float32, topk_* [..., k].
    With ``num_negatives`` the softmax runs over the batch's top-k tokens plus that many random
    negatives (see ``distill_loss``) instead of the whole vocabulary."""
    ids, logp = topk_ids.flatten(0, 1).long(), topk_logp.flatten(0, 1)
    if 0 < num_negatives < weight.shape[0]:
        negatives = torch.randint(weight.shape[0], (num_negatives,), generator=generator).to(hidden.device)
        vocab = torch.cat([ids.flatten(), negatives]).unique()
        position = torch.full((weight.shape[0],), -1, dtype=torch.long, device=hidden.device)
        position[vocab] = torch.arange(len(vocab), device=hidden.device)
        weight, ids = weight[vocab], position[ids]
    return FusedHeadTopKRestKL.apply(hidden, weight.float(), ids, logp)


def eagle_loss(head, ids, feats, topk_ids, topk_logp, cfg, generator):
    """ids [B, S]; feats [B, S, H] (the target's); topk_* [B, S, k]. -> (loss, log extras)."""
    f = feats.float()
    noise = (torch.rand(f.shape, generator=generator) * 2 - 1).to(f.device) * (cfg.feature_noise * f.std())
    with torch.autocast(f.device.type, dtype=torch.bfloat16):
        pred = dense_forward(head, ids[:, 1:], f[:, :-1] + noise[:, :-1]).float()   # ~ f[:, 1:]
    kl = _topk_kl(head, pred, topk_ids[:, 1:], topk_logp[:, 1:], cfg.num_negatives, generator)
    feat = F.smooth_l1_loss(pred, f[:, 1:])
    loss = kl + cfg.feature_loss * feat
    extra = {"kl1": round(kl.item(), 4), "feat": round(feat.item(), 4)}
    for j in range(2, cfg.unroll + 1):  # pass j: pass j-1's predictions as features, one token further
        with torch.autocast(f.device.type, dtype=torch.bfloat16):
            pred = dense_forward(head, ids[:, j:], pred[:, :-1]).float()             # ~ f[:, j:]
        kl_j = _topk_kl(head, pred, topk_ids[:, j:], topk_logp[:, j:], cfg.num_negatives, generator)
        loss = loss + 0.5 ** (j - 1) * (kl_j + cfg.feature_loss * F.smooth_l1_loss(pred, f[:, j:]))
        extra[f"kl{j}"] = round(kl_j.item(), 4)
    return loss, extra


def frequent_tokens(chunks: torch.Tensor, n: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The n most frequent token ids of the corpus (sorted), and the share of its tokens they cover.
    Tokens the corpus never shows are ranked by id: a byte-pair vocabulary numbers its merges in
    the order its own training corpus found them frequent, so low ids are the common ones."""
    counts = torch.bincount(chunks.flatten(), minlength=vocab_size)[:vocab_size]
    score = counts.double() + torch.linspace(0.5, 0.0, vocab_size, dtype=torch.float64)  # ties: low id first
    top = score.topk(min(n, vocab_size)).indices.sort().values
    return top, float(counts[top].sum() / counts.sum())


@torch.inference_mode()
def dense_chain(head, features: torch.Tensor, tokens: list[int], c: int, k: int) -> list[int]:
    """Greedy drafts of the engine's proposal at num_computed_tokens = c: the head reads real
    features f_0..f_{c-1} with tokens 1..c, then its own predictions with its own drafts."""
    ids, rows, out = list(tokens[1:c + 1]), features[:c], []
    for _ in range(k):
        pred = dense_forward(head, torch.tensor([ids], device=features.device), rows[None])[0, -1]
        tok = int(head.compute_logits(pred[None]).argmax())
        out.append(tok)
        ids.append(tok)
        rows = torch.cat([rows, pred[None].to(rows.dtype)])
    return out


@torch.inference_mode()
def evaluate_head(head, teacher, items: list[dict], k: int = 5) -> dict:
    """Per domain: teacher-forced top-1 agreement; for greedy target answers also the mean
    acceptance length of replayed K-token greedy drafting (the engine's chain, exactly)."""
    report: dict[str, dict] = {}
    for item in items:
        ids = torch.tensor([item["ids"]], device=teacher.device)
        feats = teacher.model(ids).last_hidden_state[0].float()          # [L, H]
        target_next = teacher.lm_head(feats).argmax(-1).tolist()          # token p + 1 the target picks
        lo = max(item["start"] - 1, 1)
        pred = dense_forward(head, ids[:, 1:], feats[None, :-1])[0]       # ~ f_{p+1}
        head_next = head.compute_logits(pred).argmax(-1).tolist()         # its guess of token p + 2
        agree = [head_next[p - 1] == target_next[p] for p in range(lo, len(target_next) - 1)]
        r = report.setdefault(item["domain"], {"tokens": 0, "agree": 0, "steps": 0, "emitted": 0})
        r["tokens"] += len(agree)
        r["agree"] += sum(agree)
        if item.get("greedy"):
            tokens, c = item["ids"], item["start"]        # replay: c tokens computed, token c just sampled
            while c < len(tokens) - 1:
                drafts = dense_chain(head, feats, tokens, c, min(k, len(tokens) - 1 - c))
                run = next((i for i, (d, t) in enumerate(zip(drafts, tokens[c + 1:])) if d != t), len(drafts))
                r["steps"] += 1
                r["emitted"] += run + 1
                c += run + 1
    return replay_report(report, k)


def replay_report(report: dict, k: int) -> dict:
    """Per domain: tokens, top-1 agreement and, from replayed greedy chains, the mean acceptance
    length at K = k (and the share of steps accepting each position, where counted)."""
    out = {}
    for domain, r in report.items():
        out[domain] = {"tokens": r["tokens"], "top1_agreement": round(r["agree"] / max(r["tokens"], 1), 4)}
        if r["steps"]:
            out[domain][f"replayed_accept_len_k{k}"] = round(r["emitted"] / r["steps"], 3)
            if "pos" in r:
                out[domain]["accepted_per_position"] = [round(n / r["steps"], 3) for n in r["pos"]]
    return out


def train_eagle(cfg) -> dict:
    from specdec.models.loader import load_model

    device, target_dir, work, out, tokenizer, teacher, data = prepare_run(cfg)
    stats = cfg.stats
    t = time.time()
    feats, topk_ids, topk_logp = cache_features(teacher, data["chunks"], cfg, work / "eagle_teacher")
    stats["teacher_s"] = round(time.time() - t, 1)

    target = load_model(str(target_dir), torch.float32, device)     # the frozen embedding + LM head
    for p in target.parameters():
        p.requires_grad_(False)
    head = init_head(target, seed=cfg.seed).to(device)
    chunks = data["chunks"]

    def loss_fn(idx, generator):
        return eagle_loss(head, chunks[idx].to(device), feats[idx].to(device), topk_ids[idx].to(device),
                          topk_logp[idx].to(device), cfg, generator)

    extra = {"target": str(cfg.target), "corpus_tokens": stats["corpus_tokens"]}
    t = time.time()
    log = train(head, chunks, cfg, lambda model: save_head(model, out, extra), loss_fn)
    if cfg.draft_vocab_size:
        vocab, coverage = frequent_tokens(chunks, cfg.draft_vocab_size, target.config.vocab_size)
        head.set_draft_vocab(vocab.to(device))
        stats["draft_vocab_size"], stats["draft_vocab_corpus_coverage"] = len(vocab), round(coverage, 4)
        save_head(head, out, {**extra, "draft_vocab_size": len(vocab)})
    stats["train_s"] = round(time.time() - t, 1)
    stats["train_total_s"] = log[-1]["elapsed_s"] if log else 0.0
    stats["final_train_loss"] = sum(r["kl_topk"] for r in log[-20:]) / max(1, len(log[-20:]))

    t = time.time()
    head.eval()
    report = evaluate_head(head, teacher.float(), data["eval"])
    stats["eval_s"] = round(time.time() - t, 1)
    report["_stats"] = stats
    (work / "eval.json").write_text(json.dumps(report, indent=1))
    return report
