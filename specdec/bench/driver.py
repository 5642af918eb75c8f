"""Timed generation through the engine's own step loop, with prefill and decode apart.

``timed_generate`` queues a batch, steps the engine, and splits the wall time at the
moment every request has its first token: before it is the prefill phase (its first
tokens count as prefill output), after it the decode phase. Acceptance is counted per
draft from the engine's step records (``EngineCore.add_step_observer``), so each run has
exact per-draft outcomes without reading the engine's cumulative counters.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import random
import time
from dataclasses import dataclass, field

from specdec.sampling_params import SamplingParams
from specdec.spec_decode.methods import get_method
from specdec.spec_decode.metrics import AcceptanceCounts

_request_ids = itertools.count()


@dataclass
class RunResult:
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_decode_tokens: int  # output tokens emitted after every request had its first token
    prefill_s: float
    decode_s: float
    num_steps: int
    num_decode_steps: int
    decode_breakdown_s: dict  # target forward (incl. batch prep) / drafting / verification / rest
    acceptance: AcceptanceCounts
    token_ids: list[list[int]] = field(repr=False)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def total_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.total_s if self.total_s > 0 else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_step_s(self) -> float:
        return self.decode_s / self.num_decode_steps if self.num_decode_steps else float("nan")

    def summary(self) -> dict:
        return {
            "num_requests": self.num_requests, "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens, "num_decode_tokens": self.num_decode_tokens,
            "prefill_s": self.prefill_s, "decode_s": self.decode_s, "num_steps": self.num_steps,
            "num_decode_steps": self.num_decode_steps, "decode_tokens_per_s": self.decode_tokens_per_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s, "total_tokens_per_s": self.total_tokens_per_s,
            "decode_step_ms": 1e3 * self.decode_step_s, "decode_breakdown_s": self.decode_breakdown_s,
            "acceptance": self.acceptance.as_dict() if self.acceptance.num_drafts else None,
        }


@contextlib.contextmanager
def acceptance_tap(engine):
    """Count (positions drafted, drafts accepted) per draft while the block runs."""
    counts = AcceptanceCounts()

    def observe(record):
        for _, _, num_positions, num_accepted in record.drafts():
            counts.add(num_positions, num_accepted)

    engine.add_step_observer(observe)
    try:
        yield counts
    finally:
        engine.remove_step_observer(observe)


def _timers(engine) -> tuple[float, float, float, float]:
    m = engine.spec_metrics
    return m.time_target, m.time_drafting, m.time_sampling, m.time_comm


def timed_generate(llm, prompts: list[list[int]], params: SamplingParams) -> RunResult:
    """Generate one completion per prompt; every request is queued at once."""
    engine = llm.engine
    if params.n != 1:
        raise ValueError("benchmarks time one completion per prompt (n=1)")
    ids = [f"bench-{next(_request_ids)}" for _ in prompts]
    counts_so_far = dict.fromkeys(ids, 0)
    tokens: dict[str, list[int]] = {}
    num_steps = num_decode_steps = 0
    decode_start = t_prefill_end = None
    timers_at_decode = None
    with acceptance_tap(engine) as acceptance:
        t0 = time.perf_counter()
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            num_steps += 1
            if decode_start is not None:
                num_decode_steps += 1
            for out in outputs:
                counts_so_far[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            if decode_start is None and all(counts_so_far.values()):
                t_prefill_end = time.perf_counter()
                decode_start = sum(counts_so_far.values())
                timers_at_decode = _timers(engine)
        t_end = time.perf_counter()
    if t_prefill_end is None:
        raise RuntimeError("generation ended before every request produced a token")
    target, drafting, sampling, comm = (a - b for a, b in zip(_timers(engine), timers_at_decode))
    decode_s = t_end - t_prefill_end
    num_output = sum(len(t) for t in tokens.values())
    return RunResult(
        num_requests=len(prompts), num_prompt_tokens=sum(len(p) for p in prompts), num_output_tokens=num_output,
        num_decode_tokens=num_output - decode_start, prefill_s=t_prefill_end - t0, decode_s=decode_s,
        num_steps=num_steps, num_decode_steps=num_decode_steps,
        decode_breakdown_s={"target_forward": target, "drafting": drafting, "verification": sampling,
                            "other": decode_s - target - drafting - sampling,
                            "communication": comm},  # tensor parallelism: inside the parts above
        acceptance=acceptance, token_ids=[tokens[i] for i in ids],
    )


# ---- prompts of exactly input_len tokens ----
def _usable_token_ids(llm) -> list[int]:
    tok = llm.tokenizer
    special = set(getattr(tok, "all_special_ids", []) or [])
    upper = min(len(tok), llm.engine.vocab_size)
    return [i for i in range(upper) if i not in special]


def random_prompts(llm, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Uniformly random (non-special) token ids: nothing for n-gram lookup to find."""
    rng = random.Random(seed)
    ids = _usable_token_ids(llm)
    return [[rng.choice(ids) for _ in range(input_len)] for _ in range(num_prompts)]


def _corpus_ids(llm) -> list[int]:
    import argparse
    import json.decoder
    import textwrap

    text = "\n".join(inspect.getsource(m) for m in (textwrap, json.decoder, argparse))
    return [t for t in llm.tokenizer.encode(text) if t < llm.engine.vocab_size]


def text_prompts(llm, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Windows of fixed source text (Python standard library), cut to exactly input_len tokens."""
    corpus = _corpus_ids(llm)
    while len(corpus) < 2 * input_len:
        corpus = corpus + corpus
    rng = random.Random(seed)
    starts = [rng.randrange(len(corpus) - input_len) for _ in range(num_prompts)]
    return [corpus[s:s + input_len] for s in starts]


# Code-completion prompts (the "code" prompt set): what a coding assistant is asked to continue.
CODE_PROMPTS = (
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(x):",
    "class Stack:\n    def __init__(self):",
    "def quicksort(items):",
    "def read_csv(path):\n    \"\"\"Read a CSV file into a list of dicts.\"\"\"",
    "async def fetch(session, url):",
    "def binary_search(arr, target):",
    "class LRUCache:\n    def __init__(self, capacity: int):",
)


def code_prompts(llm, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """The CODE_PROMPTS in turn from the seed's offset, tokenized as they are (their own lengths;
    --input-len does not apply): repetitions with different seeds see different prompts."""
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode(CODE_PROMPTS[(seed + i) % len(CODE_PROMPTS)]) for i in range(num_prompts)]


def make_prompts(llm, kind: str, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    if input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {input_len}")
    if kind == "random":
        return random_prompts(llm, num_prompts, input_len, seed)
    if kind == "text":
        return text_prompts(llm, num_prompts, input_len, seed)
    if kind == "code":
        return code_prompts(llm, num_prompts, seed)
    raise ValueError(f"--prompts must be 'random', 'text' or 'code', got {kind!r}")


def greedy_params(output_len: int, temperature: float = 0.0, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=seed)


def takes_references(llm) -> bool:
    """Whether the engine's proposer follows given continuations (the "replay" method's control)."""
    spec = llm.engine.config.speculative_config
    return spec is not None and "set_references" in get_method(spec.method).controls


def register_references(llm, prompts: list[list[int]], continuations: list[list[int]]) -> bool:
    """Give a replay proposer the target's own greedy continuations; False if it is another method."""
    if not takes_references(llm):
        return False
    llm.engine.executor.control_proposer("set_references", list(zip(prompts, continuations)))
    return True


def warmup(llm, num_tokens: int = 8, seed: int = 12345) -> None:
    prompt = random_prompts(llm, 1, 16, seed)
    timed_generate(llm, prompt, greedy_params(num_tokens))


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How far greedy outputs agree: identical sequences, and the mean common-prefix fraction."""
    identical = prefix = 0.0
    for a, b in zip(reference, other):
        identical += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n / max(len(a), 1)
    num = max(len(reference), 1)
    return {"identical_fraction": identical / num, "mean_prefix_agreement": prefix / num}


def draft_cost_ratio(llm, num_tokens: int, repeats: int = 5) -> dict | None:
    """Measured c: one draft forward / one target forward over ``num_tokens`` decode-like rows.

    Uses ``time_forward``, which writes KV slots of free blocks: call it before the engine
    serves any request (a prefix-cached block it overwrote would go stale).
    """
    spec = llm.engine.config.speculative_config
    if spec is None or not get_method(spec.method).has_draft_model:
        return None
    executor = llm.engine.executor
    t_target = min(executor.collective_rpc("time_forward", "target", num_tokens) for _ in range(repeats))
    t_draft = min(executor.collective_rpc("time_forward", "draft", num_tokens) for _ in range(repeats))
    return {"num_tokens": num_tokens, "target_forward_s": t_target, "draft_forward_s": t_draft,
            "cost_ratio": t_draft / t_target, "source": "time_forward"}
