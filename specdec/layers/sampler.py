"""Sampler: per-request logits processing (penalties, temperature, top-k, top-p, min-p) and
sampling without a host sync. The rejection sampler reuses `processed_probs` and
`sample_from_probs`, so plain decoding and speculative verification share one definition of
the target distribution p."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Sampling controls as batched tensors, one row per request (or per scored position after
    `expand`). Greedy rows carry temperature 0 and neutral truncation values (top_k 0, top_p 1,
    min_p 0) so that a greedy request never makes the batch pay for a sort."""

    temperature: torch.Tensor  # [R] float32; 0 => greedy
    top_k: torch.Tensor  # [R] int64; 0 => disabled
    top_p: torch.Tensor  # [R] float32; 1.0 => disabled
    min_p: torch.Tensor  # [R] float32; 0 => disabled
    presence_penalty: torch.Tensor  # [R] float32
    frequency_penalty: torch.Tensor  # [R] float32
    repetition_penalty: torch.Tensor  # [R] float32
    generators: list[torch.Generator | None]  # [R]; a seeded request's own generator, None => global RNG
    # Host-side flags, so that work no row needs is skipped without reading tensors back.
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool

    @classmethod
    def from_params(
        cls, params: list[SamplingParams], generators: list[torch.Generator | None], device
    ) -> "SamplingMetadata":
        if len(params) != len(generators):
            raise ValueError(f"got {len(params)} SamplingParams but {len(generators)} generators")
        greedy = [p.is_greedy for p in params]
        temperature = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            temperature=floats(temperature),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=floats(top_p),
            min_p=floats(min_p),
            presence_penalty=floats([p.presence_penalty for p in params]),
            frequency_penalty=floats([p.frequency_penalty for p in params]),
            repetition_penalty=floats([p.repetition_penalty for p in params]),
            generators=list(generators),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_k=all(k == 0 for k in top_k),
            no_top_p=all(p >= 1.0 for p in top_p),
            no_min_p=all(m == 0.0 for m in min_p),
            no_penalties=not any(p.has_penalties for p in params),
        )

    def expand(self, repeats: list[int]) -> "SamplingMetadata":
        """Repeat request r's row `repeats[r]` times (e.g. K+1 rows for its verified positions).
        Repeated rows share the request's generator object, so draws stay in one stream."""
        counts = torch.tensor(repeats, dtype=torch.int64, device=self.temperature.device)
        total = sum(repeats)

        def rep(t: torch.Tensor) -> torch.Tensor:
            return torch.repeat_interleave(t, counts, output_size=total)  # output_size: no sync

        return SamplingMetadata(
            temperature=rep(self.temperature),
            top_k=rep(self.top_k),
            top_p=rep(self.top_p),
            min_p=rep(self.min_p),
            presence_penalty=rep(self.presence_penalty),
            frequency_penalty=rep(self.frequency_penalty),
            repetition_penalty=rep(self.repetition_penalty),
            generators=[g for g, n in zip(self.generators, repeats) for _ in range(n)],
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            no_top_k=self.no_top_k,
            no_top_p=self.no_top_p,
            no_min_p=self.no_min_p,
            no_penalties=self.no_penalties,
        )


def _token_counts(token_ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[N, V] int64 occurrence counts; ragged rows are padded with the out-of-vocab id V."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = torch.tensor(
        [ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids], dtype=torch.int64, device=device
    ).view(len(token_ids), max_len)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,  # [N, V]
    meta: SamplingMetadata,  # N rows
    prompt_token_ids: list[list[int]],  # [N][*]
    output_token_ids: list[list[int]],  # [N][*] tokens generated so far (for a verified position: incl. drafts before it)
) -> torch.Tensor:
    """vLLM semantics, in place: repetition penalty on every token seen in prompt or output
    (positive logits divided, negative multiplied), then `frequency * count_in_output` and
    `presence * (count_in_output > 0)` subtracted."""
    if meta.no_penalties:
        return logits
    num_rows, vocab_size = logits.shape
    output_counts = _token_counts(output_token_ids, vocab_size, logits.device)  # [N, V]
    seen = (_token_counts(prompt_token_ids, vocab_size, logits.device) > 0) | (output_counts > 0)
    repetition = torch.where(seen, meta.repetition_penalty[:, None], 1.0).to(logits.dtype)  # [N, V]
    logits.copy_(torch.where(logits > 0, logits / repetition, logits * repetition))
    logits -= meta.frequency_penalty[:, None].to(logits.dtype) * output_counts
    logits -= meta.presence_penalty[:, None].to(logits.dtype) * (output_counts > 0)
    return logits


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k via `topk` (no full sort). Ties with the k-th value are kept, as in vLLM."""
    vocab_size = logits.shape[-1]
    disabled = (top_k <= 0) | (top_k >= vocab_size)  # [N]
    k = top_k.masked_fill(disabled, 1)
    max_k = int(k.max())  # host read: `topk` needs a Python int
    kth_largest = logits.topk(max_k, dim=-1).values.gather(1, (k - 1)[:, None])  # [N, 1]
    kth_largest.masked_fill_(disabled[:, None], float("-inf"))
    return logits.masked_fill_(logits < kth_largest, float("-inf"))


def _apply_top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p on one ascending sort (vLLM's algorithm): top-p drops the smallest
    tokens whose cumulative (top-k renormalised) probability stays <= 1 - top_p; the largest
    token is always kept."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=False)  # [N, V]
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # disabled => k = V, keeps all
    kth_largest = sorted_logits.gather(1, (vocab_size - k)[:, None])  # [N, 1]
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    drop = cumulative <= (1.0 - top_p)[:, None]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_index, sorted_logits)


TOP_P_HEAD = 1024  # candidates the CPU top-p path sorts instead of the whole vocabulary


def _apply_top_k_top_p_head(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            num_candidates: int = TOP_P_HEAD) -> torch.Tensor:
    """The cut of `_apply_top_k_top_p_sorted` (in place, like it), from each row's `num_candidates` largest logits
    (one `topk`, a partial selection, instead of a sort of the whole vocabulary: 49k-152k
    entries). Exact whenever the head holds the cut: top-k no larger than the head, no tie at
    its edge, and head mass reaching top-p (a token outside it then has at least top_p of the
    mass above it, so top-p drops it). Rows where any of that fails go through the sort.
    Differs from the sort only where the mass above a token is within float rounding of top_p,
    or among tokens with exactly equal logits (the sort's own order among them is arbitrary)."""
    num_rows, vocab_size = logits.shape
    c = min(num_candidates, vocab_size)
    values, index = logits.topk(c, dim=-1)  # [N, C] descending
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [N]; disabled => V
    has_k, has_p = k < vocab_size, top_p < 1.0
    kth = values.gather(1, (k.clamp(max=c) - 1)[:, None])  # [N, 1] valid where k <= C
    head = values.masked_fill(has_k[:, None] & (values < kth), float("-inf"))
    weights = torch.exp(head - values[:, :1])  # [N, C]
    total = torch.where(has_k, weights.sum(dim=-1), torch.exp(logits - values[:, :1]).sum(dim=-1))  # [N]
    inclusive = weights.cumsum(dim=-1) / total[:, None]
    head = head.masked_fill(has_p[:, None] & (inclusive - weights / total[:, None] >= top_p[:, None]), float("-inf"))
    full = has_k & ((k > c) | (values[:, -1:] >= kth).squeeze(1) & (c < vocab_size))
    full |= ~has_k & has_p & (inclusive[:, -1] < top_p)
    active = (has_k | has_p) & ~full
    # in place: active rows become their kept head; other rows get their own head values back
    logits.masked_fill_(active[:, None], float("-inf")).scatter_(1, index, torch.where(active[:, None], head, values))
    if full.any():
        rows = full.nonzero().squeeze(1)
        logits[rows] = _apply_top_k_top_p_sorted(logits[rows], top_k[rows], top_p[rows])
    return logits


def processed_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[N, V] float32 probabilities after temperature, top-k, top-p, min-p (vLLM v0 order),
    renormalised. The caller's `logits` are not modified. Greedy rows (temperature 0) are
    processed at temperature 1: finite, and never used."""
    temperature = torch.where(meta.temperature > 0, meta.temperature, 1.0)  # [N]
    logits = logits.float() / temperature[:, None]  # a fresh tensor; the in-place fills below are safe
    if not meta.no_top_p:
        if logits.device.type == "cpu":  # a host read decides which rows need the sort
            logits = _apply_top_k_top_p_head(logits, meta.top_k, meta.top_p)
        else:
            logits = _apply_top_k_top_p_sorted(logits, meta.top_k, meta.top_p)
    elif not meta.no_top_k:
        logits = _apply_top_k_only(logits, meta.top_k)
    probs = logits.softmax(dim=-1)
    if not meta.no_min_p:
        # min-p: drop tokens below min_p * (largest probability); the ratio is scale-free, so it
        # can be taken after the softmax of the already truncated row.
        threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p[:, None]  # [N, 1]
        probs = probs.masked_fill_(probs < threshold, 0.0)
        probs = probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


def sample_from_probs(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[N] int64, one draw per row by the exponential race: argmax_v probs[v] / E_v with
    E_v ~ Exp(1) i.i.d. picks v with probability probs[v] / sum(probs) (no normalisation
    needed, no host sync, unlike torch.multinomial). Row i draws its V exponentials from
    meta.generators[i] when set, so a seeded row is independent of the rest of the batch."""
    noise = torch.empty_like(probs, dtype=torch.float32)  # [N, V]
    if any(g is None for g in meta.generators):
        noise.exponential_()
    for row, generator in enumerate(meta.generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # An exponential draw can be exactly 0; 0/0 would be NaN and win the argmax for an
    # impossible token, so floor the noise at the smallest normal float.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return probs.div(noise).argmax(dim=-1)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[N] int64: argmax of the logits for greedy rows, a draw from processed_probs otherwise."""
    greedy_tokens = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy_tokens
    random_tokens = sample_from_probs(processed_probs(logits, meta), meta)
    if meta.all_random:
        return random_tokens
    return torch.where(meta.temperature == 0, greedy_tokens, random_tokens)
