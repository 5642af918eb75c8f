"""Suffix proposer tests, plus the synthetic code-editing / agentic workloads it is judged
on. ``python tests/spec_decode/test_suffix.py`` prints the full suffix-vs-ngram table."""
import importlib
import inspect
import random
import re

import numpy as np
import pytest

from specdec.bench.proposer_replay import simulate, simulate_acceptance
from specdec.spec_decode.ngram import NgramProposer
from specdec.spec_decode.suffix import (
    GlobalTokenStore,
    SuffixProposer,
    draft_from_occurrences,
)

TOKEN_RE = re.compile(r"\w+|\s+|[^\w\s]")  # words, whitespace runs, single punctuation


class Vocab:
    def __init__(self):
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(piece, len(self.ids)) for piece in TOKEN_RE.findall(text)]


def edit_source(source: str, rng: random.Random, num_edits: int) -> str:
    """A few small edits: rename in a line, insert a comment, delete a line, replace a line."""
    lines = source.splitlines(keepends=True)
    code_lines = [i for i, line in enumerate(lines) if line.strip() and not line.strip().startswith("#")]
    for i in sorted(rng.sample(code_lines, num_edits), reverse=True):
        line = lines[i]
        indent = line[: len(line) - len(line.lstrip())]
        words = re.findall(r"[A-Za-z_]\w{2,}", line)
        op = rng.choice(["rename", "insert", "delete", "replace"])
        if op == "rename" and words:
            word = rng.choice(words)
            lines[i] = re.sub(rf"\b{word}\b", word + "_new", line)
        elif op == "insert":
            lines.insert(i, f"{indent}# NOTE: reviewed edge case {i}\n")
        elif op == "delete":
            del lines[i]
        else:
            lines[i] = f"{indent}result = helper_{i}(value)  # replaced\n"
    return "".join(lines)


def code_edit_workload(vocab, module_names, num_edits=4, seed=0, rounds=1):
    """Prompt: a stdlib module's source + instruction; output: the file with a few edits.
    ``rounds`` > 1 repeats the modules with fresh edits (an agent re-editing the same files)."""
    rng, sequences = random.Random(seed), []
    for _ in range(rounds):
        for name in module_names:
            source = inspect.getsource(importlib.import_module(name))
            prompt = (f"You are editing {name}.py. Apply the requested edits and print the whole file.\n"
                      f"```python\n{source}```\nUpdated file:\n```python\n")
            sequences.append((vocab.encode(prompt), vocab.encode(edit_source(source, rng, num_edits) + "```\n")))
    return sequences


SYSTEM = ("You are a coding agent. You can call tools. To edit a file, emit a <tool_call> block with a "
          "JSON object naming the tool and its arguments. Make the smallest change that completes the "
          "task and explain it in one sentence.\n")


def agent_workload(vocab, module_names, num_requests, seed=0):
    """Repeated similar requests: rename a variable in one stdlib function via a tool call.
    Each output is a fixed template around a line copied from the prompt."""
    rng, functions = random.Random(seed), []
    for name in module_names:
        module = importlib.import_module(name)
        for function_name, function in sorted(inspect.getmembers(module, inspect.isfunction)):
            if function.__module__ == name:
                try:
                    source = inspect.getsource(function)
                except OSError:  # e.g. functions created by exec
                    continue
                if 3 < source.count("\n") < 60:
                    functions.append((name, function_name, source))
    rng.shuffle(functions)
    sequences = []
    for name, function_name, source in functions[:num_requests]:
        lines = [line for line in source.splitlines()
                 if re.search(r"[A-Za-z_]\w{2,}", line) and not line.strip().startswith(("def ", "#", '"'))]
        line = rng.choice(lines)
        var = rng.choice(re.findall(r"[A-Za-z_]\w{2,}", line))
        new_line = re.sub(rf"\b{var}\b", var + "_renamed", line)
        prompt = (f"{SYSTEM}File: {name}.py\n```python\n{source}```\n"
                  f"Task: in `{function_name}`, rename `{var}` to `{var}_renamed` on the line that uses it.\n")
        old, new = line.replace('"', '\\"'), new_line.replace('"', '\\"')
        output = (f"I'll rename `{var}` to `{var}_renamed` in `{function_name}`.\n<tool_call>\n"
                  f'{{"name": "str_replace", "arguments": {{"path": "{name}.py", "old_str": "{old}", '
                  f'"new_str": "{new}"}}}}\n</tool_call>\n'
                  f"Done: `{var}` is now `{var}_renamed` in `{function_name}`; behaviour is unchanged.\n")
        sequences.append((vocab.encode(prompt), vocab.encode(output)))
    return sequences


def test_draft_follows_the_most_frequent_continuation_and_breaks_ties_by_recency():
    haystack = np.array([5, 1, 5, 2, 5, 1, 5, 3, 5])
    draft, score = draft_from_occurrences(haystack, np.array([0, 2, 4, 6]), 1, 0.0)
    assert draft == [1] and score == pytest.approx(0.5)  # "1" follows 5 twice out of four
    draft, _ = draft_from_occurrences(np.array([5, 2, 5, 3, 5]), np.array([0, 2]), 1, 0.0)
    assert draft == [3]  # 1:1 tie -> the later occurrence


def test_draft_stops_at_separators_and_low_probability():
    haystack = np.array([7, 8, 9, -1, 7, 8])
    assert draft_from_occurrences(haystack, np.array([0]), 5, 0.1) == ([8, 9], 2.0)
    split = np.array([7, 1, -1, 7, 2, -1, 7, 3, -1])
    assert draft_from_occurrences(split, np.array([0, 3, 6]), 3, 0.5) == ([], 0.0)  # each 1/3 < 0.5


def test_global_store_occurrences_match_brute_force_across_index_tail_and_eviction():
    rng = np.random.default_rng(1)
    store = GlobalTokenStore(max_tokens=20_000, tail_tokens=300)
    sequences = [rng.integers(0, 5, size=rng.integers(50, 3000)) for _ in range(40)]
    for sequence in sequences:
        store.add(sequence)
        assert store.num_tokens <= store.max_tokens
        assert len(store.segments) <= 8  # log-structured: O(log(max_tokens / tail_tokens))
        tokens = store.tokens[: store.num_tokens]
        expected = np.flatnonzero((tokens[:-1] == 3) & (tokens[1:] == 4)) + 1
        np.testing.assert_array_equal(store.occurrences(3, 4, 10**9), expected)
    kept = store.tokens[: store.num_tokens]
    np.testing.assert_array_equal(kept[-len(sequences[-1]) - 1 : -1], sequences[-1])  # newest survives
    np.testing.assert_array_equal(store.occurrences(3, 4, 7), expected[-7:])


def test_local_match_uses_the_longest_context():
    # "a b c" occurs twice with different continuations; the longer "x a b c" picks the first.
    proposer = SuffixProposer(num_speculative_tokens=3, max_store_tokens=0)
    context = [9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 7, 7, 7, 9, 1, 2, 3]
    assert proposer.propose([context], [3], ["r"]) == [[4, 5, 6]]


def test_global_store_proposes_text_that_is_in_no_prompt():
    proposer = SuffixProposer(num_speculative_tokens=4)
    template = [100, 101, 102, 103, 104, 105, 106, 107]
    proposer.propose([[1, 2, 3]], [4], ["first"])  # first propose marks the prompt boundary
    proposer.on_request_finished("first", [1, 2, 3] + template)
    assert proposer.propose([[50, 51, 100, 101, 102, 103]], [4], ["second"]) == [[104, 105, 106, 107]]
    fresh = SuffixProposer(num_speculative_tokens=4)
    assert fresh.propose([[50, 51, 100, 101, 102, 103]], [4], ["second"]) == [[]]
    proposer.reset_history()  # what benchmark repetitions do: the store forgets, nothing else changes
    assert proposer.propose([[50, 51, 100, 101, 102, 103]], [4], ["third"]) == [[]]


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(num_speculative_tokens=0), "num_speculative_tokens"), (dict(num_speculative_tokens=4, max_depth=1), "max_depth"),
     (dict(num_speculative_tokens=4, spec_factor=0), "spec_factor"),
     (dict(num_speculative_tokens=4, min_token_prob=2.0), "min_token_prob")],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SuffixProposer(**kwargs)


class OracleProposer:
    """Proposes the true continuation, corrupting every 3rd step's 2nd token."""

    def __init__(self, sequences):
        self.truth, self.calls = {f"simulated-{i}": list(p) + list(o) for i, (p, o) in enumerate(sequences)}, 0

    def propose(self, token_ids, num_tokens, request_ids):
        self.calls += 1
        start = len(token_ids[0])
        draft = self.truth[request_ids[0]][start : start + num_tokens[0]]
        if self.calls % 3 == 0 and len(draft) >= 2:
            draft[1] = -5
        return [draft]

    def on_request_finished(self, request_id, token_ids, num_prompt_tokens=None):
        pass


def test_simulate_counts_teacher_forced_acceptance():
    sequences = [([1, 2], list(range(10, 30)))]  # 20 output tokens, k = 4
    stats = simulate(OracleProposer(sequences), sequences, 4)
    # t=0: 4 accepted (+1), t=5: 4, t=10: corrupted -> 1, t=12: 4, t=17: only 3 true tokens left -> 3
    assert [stats.num_steps, stats.num_accepted_tokens] == [5, 16]
    assert simulate_acceptance(OracleProposer(sequences), sequences, 4) == pytest.approx(16 / 5)


def test_suffix_beats_prompt_lookup_on_code_editing_and_agentic_workloads():
    vocab = Vocab()
    workloads = {
        "code edit": code_edit_workload(vocab, ["fnmatch", "colorsys", "bisect"], seed=0, rounds=2),
        "agent": agent_workload(vocab, ["textwrap", "shlex", "fnmatch", "posixpath", "genericpath"], 16),
    }
    for name, sequences in workloads.items():
        suffix = simulate(SuffixProposer(8), sequences, 8)
        for lookup_min, lookup_max in ((1, 3), (2, 5), (3, 8)):
            ngram = simulate(NgramProposer(lookup_min, lookup_max, 8), sequences, 8)
            assert suffix.mean_accepted_per_step > ngram.mean_accepted_per_step, (name, lookup_min, lookup_max)
            assert suffix.acceptance_rate > ngram.acceptance_rate, (name, lookup_min, lookup_max)
    agent_without_store = simulate(SuffixProposer(8, max_store_tokens=0), workloads["agent"], 8)
    assert simulate(SuffixProposer(8), workloads["agent"], 8).mean_accepted_per_step > 2 * (
        agent_without_store.mean_accepted_per_step)  # the template is learnt from earlier requests


def main() -> None:  # python tests/spec_decode/test_suffix.py [K]
    import sys
    import time

    k = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    vocab = Vocab()
    workloads = {
        "code edit (6 files)": code_edit_workload(vocab, ["textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq"]),
        "code edit, 3 rounds": code_edit_workload(vocab, ["textwrap", "shlex", "fnmatch"], seed=1, rounds=3),
        "agent tool calls (40)": agent_workload(vocab, ["textwrap", "shlex", "heapq", "string", "glob", "posixpath",
                                                        "genericpath", "fnmatch", "shutil"], 40),
    }
    proposers = {
        "ngram 1-3": lambda: NgramProposer(1, 3, k), "ngram 2-5": lambda: NgramProposer(2, 5, k),
        "ngram 3-8": lambda: NgramProposer(3, 8, k), "suffix": lambda: SuffixProposer(k),
        "suffix, no global store": lambda: SuffixProposer(k, max_store_tokens=0),
        "suffix, spec_factor 4": lambda: SuffixProposer(k, spec_factor=4.0),
    }
    print(f"K={k}; mean accepted drafts per step (tokens per step = +1), acceptance rate, proposer us/step")
    for workload, sequences in workloads.items():
        num_prompt, num_output = sum(len(p) for p, _ in sequences), sum(len(o) for _, o in sequences)
        print(f"\n{workload}: {len(sequences)} requests, {num_prompt} prompt / {num_output} output tokens")
        for name, make in proposers.items():
            start = time.perf_counter()
            stats = simulate(make(), sequences, k)
            seconds = time.perf_counter() - start
            print(f"  {name:24s} {stats.mean_accepted_per_step:5.2f}  {stats.acceptance_rate:5.2f}  "
                  f"{seconds / stats.num_steps * 1e6:6.0f}")


if __name__ == "__main__":
    main()
