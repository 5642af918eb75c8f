import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.spec_decode.ngram import (
    NgramProposer,
    TokenArrayCache,
    common_suffix_lengths,
    find_ngram_continuation,
)


def reference_continuation(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, by brute force: longest n first, then the latest earlier start."""
    num_tokens = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > num_tokens - 1:
            continue
        suffix = tokens[num_tokens - n:]
        for start in range(num_tokens - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 5),
    k=st.integers(1, 6),
)
def test_matches_brute_force_definition(tokens, min_n, extra_n, k):
    expected = reference_continuation(tokens, min_n, min_n + extra_n, k)
    assert find_ngram_continuation(tokens, min_n, min_n + extra_n, k) == expected
    assert find_ngram_continuation(np.asarray(tokens, dtype=np.int32), min_n, min_n + extra_n, k) == expected


def test_longest_ngram_beats_a_more_recent_shorter_one():
    #        [1 2 3] 7 8   ...  [2 3] 9   ...  1 2 3
    tokens = [1, 2, 3, 7, 8, 5, 2, 3, 9, 6, 1, 2, 3]
    assert find_ngram_continuation(tokens, 1, 3, 2) == [7, 8]
    assert find_ngram_continuation(tokens, 1, 2, 2) == [9, 6]  # with n <= 2 the latest "2 3" wins


def test_most_recent_occurrence_and_short_tail():
    tokens = [4, 1, 5, 4, 1, 6, 4, 1]
    assert find_ngram_continuation(tokens, 2, 2, 3) == [6, 4, 1]
    # max_n = 1: the latest "0" wins even though an older "1 0" also matches (found by hypothesis)
    assert find_ngram_continuation([1, 0, 0, 1, 0], 1, 1, 1) == [1]
    assert find_ngram_continuation([9, 9, 9], 1, 2, 5) == [9]  # context ends after one token


def test_no_match_and_min_n_filter():
    assert find_ngram_continuation([1, 2, 3, 4], 1, 3, 4) == []
    assert find_ngram_continuation([1, 2, 3, 9, 3], 2, 3, 4) == []  # only a 1-gram repeats
    assert find_ngram_continuation([1, 2, 3, 9, 3], 1, 3, 4) == [9, 3]
    assert find_ngram_continuation([], 1, 3, 4) == []
    assert find_ngram_continuation([5], 1, 3, 4) == []


def test_common_suffix_lengths_window_and_filter_paths_agree():
    rng = np.random.default_rng(0)
    haystack = rng.integers(0, 2, size=20_000)  # many candidates: exercises the filter path
    pattern = haystack[-24:]
    ends = np.flatnonzero(haystack[:-1] == haystack[-1])
    lengths = common_suffix_lengths(haystack, ends, pattern)
    for end, length in zip(ends[::97].tolist(), lengths[::97].tolist()):
        expected = 0
        while expected < 24 and end - expected >= 0 and haystack[end - expected] == pattern[-1 - expected]:
            expected += 1
        assert length == expected


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt_lookup_min=0, prompt_lookup_max=3, num_speculative_tokens=4), "prompt_lookup_min"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2, num_speculative_tokens=4), "prompt_lookup_max"),
        (dict(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=17), "num_speculative_tokens"),
        (dict(prompt_lookup_min=1.5, prompt_lookup_max=3, num_speculative_tokens=4), "prompt_lookup_min"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(**kwargs)


def test_propose_batches_and_respects_num_tokens():
    proposer = NgramProposer(1, 3, 4)
    contexts = [[1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8], [1, 2, 3]]
    drafts = proposer.propose(contexts, [2, 0, 4], ["a", "b", "c"])
    assert drafts == [[3, 4], [], []]
    assert proposer.propose([contexts[0]], [10], ["a"]) == [[3, 4, 5, 1]]  # capped at K = 4
    with pytest.raises(ValueError, match="equal lengths"):
        proposer.propose(contexts, [1, 1], ["a", "b", "c"])


def test_incremental_cache_equals_stateless_search_and_detects_reuse():
    rng = random.Random(0)
    proposer = NgramProposer(1, 4, 5)
    tokens = [rng.randrange(6) for _ in range(50)]
    for step in range(200):
        tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 4)))
        assert proposer.propose([tokens], [5], ["r"]) == [find_ngram_continuation(tokens, 1, 4, 5)]
    other = [rng.randrange(6) for _ in range(60)]  # same id, different request: must not reuse the array
    assert proposer.propose([other], [5], ["r"]) == [find_ngram_continuation(other, 1, 4, 5)]
    proposer.on_request_finished("r", other)
    assert len(proposer._token_arrays) == 0


def test_token_array_cache_is_bounded():
    cache = TokenArrayCache(max_requests=3)
    for index in range(5):
        cache.view(f"r{index}", [index, index + 1])
    assert len(cache) == 3
    assert cache.view("r4", [4, 5, 6]).tolist() == [4, 5, 6]
