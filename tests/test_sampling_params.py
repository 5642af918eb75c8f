"""SamplingParams: vLLM defaults and normalisation, and a ValueError naming each bad field."""
import pytest

from specdec import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 16, 0)
    assert p.stop == [] and p.stop_token_ids == [] and p.use_speculation
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "disabled"
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_clone_revalidates():
    p = SamplingParams(temperature=0.5, stop=["a"])
    q = p.clone(top_k=3)
    assert (q.temperature, q.top_k, q.stop) == (0.5, 3, ["a"]) and p.top_k == 0
    with pytest.raises(ValueError, match="top_k"):
        p.clone(top_k=-5)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("seed", 1.5), ("seed", "1"),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("logprobs", -1), ("logprobs", 21),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("nan")),
    # finite and bounded: values that overflow the step's tensors or make the logits garbage
    ("top_k", 2**63), ("top_k", 2**31), ("temperature", float("inf")), ("temperature", 1e308), ("temperature", 50),
    ("repetition_penalty", float("inf")), ("repetition_penalty", 1e-300), ("top_p", float("nan")),
    ("presence_penalty", float("inf")), ("min_p", float("nan")), ("seed", 2**63), ("seed", -(2**63) - 1),
    ("max_tokens", 2**62), ("min_tokens", 2**40), ("n", 2**40), ("stop_token_ids", [2**63]),
])
def test_each_bad_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b") as e:
        SamplingParams(**{field: value})
    assert repr(value) in str(e.value) or str(value) in str(e.value)  # says what it got


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens \(4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5


def test_range_edges_are_accepted():
    p = SamplingParams(temperature=2.0, top_k=2**31 - 1, repetition_penalty=10.0, seed=2**63 - 1, min_p=1.0)
    assert (p.temperature, p.top_k, p.seed) == (2.0, 2**31 - 1, 2**63 - 1)
    assert SamplingParams(repetition_penalty=0.1, seed=-(2**63), stop_token_ids=[2**31 - 1]).seed == -(2**63)
