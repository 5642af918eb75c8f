"""Shared fixtures: tiny random checkpoints (built once per session) and prompts.

Every checkpoint shares one trained byte-level BPE tokenizer (training it is the slow part),
so drafts and targets speak the same token ids. Engines run in float32 on the CPU, where
specdec promises token-identical greedy output.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Triton fixes interpreter vs compiled mode at import: without a GPU every kernel test runs
# interpreted, so set it before anything can import triton (on a GPU the kernels compile).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite uses a dozen C++ CPU kernels, each compiled on first use (15-60 s on a fresh machine):
# one process builds them all in the background from the start (specdec.kernels.cpu.prebuild),
# next to the tests, which wait for a kernel only while its build is under way. So that collecting
# builds nothing, a skip that depends on a kernel is a string condition (pytest evaluates it when
# the test is set up). SPECDEC_TEST_PREBUILD=0 leaves every build to first use.
_prebuild: subprocess.Popen | None = None


def pytest_configure(config):
    global _prebuild
    if os.environ.get("SPECDEC_TEST_PREBUILD", "1") != "0" and _prebuild is None:
        import specdec

        env = dict(os.environ)  # the builder imports the specdec these tests import
        env["PYTHONPATH"] = os.pathsep.join([str(Path(specdec.__file__).parents[1]), env.get("PYTHONPATH", "")])
        _prebuild = subprocess.Popen([sys.executable, "-m", "specdec.kernels.cpu.prebuild", "--jobs", "1", "--quiet"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)  # Ctrl-C reaches it through unconfigure


def pytest_unconfigure(config):
    # SIGTERM: the builder starts no further build and exits once the one under way is done (a
    # compiler killed mid-build would leave its folder's lock behind for the next run to wait on)
    if _prebuild is not None and _prebuild.poll() is None:
        _prebuild.terminate()


# Tiny models gain nothing from intra-op threads, and on shared, busy cores the thread pool's
# spin-waits make every op 10x slower: one thread keeps the suite fast.
torch.set_num_threads(1)

# Code-like text: the tiny tokenizer was trained on Python sources, so these encode compactly
# and their lengths (3..60 tokens) differ, which exercises ragged batches.
PROMPTS = [
    "def f(x):",
    "import json",
    "class Decoder(object):",
    "    return value",
    "for i in range(10):",
    "if not isinstance(obj, dict):",
    "Hello",
    "x = [1, 2, 3]",
    "while True:\n    pass",
    "raise ValueError(msg)",
    "def dedent(text):\n    \"\"\"Remove any common leading whitespace from every line in `text`.",
    "try:\n    import json\nexcept ImportError:",
    "a",
    "lines = text.splitlines()",
    "The quick brown fox",
    "print('hello world')",
    "return self.encode(o)",
    "def indent(text, prefix, predicate=None):",
    "chunks = self._split(text)",
    "# comment",
    "width = 70",
    "s = json.dumps(obj, indent=4)",
    "    def __init__(self, *, skipkeys=False, ensure_ascii=True):",
    "z",
]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from specdec.models.tiny import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="session")
def make_model(tmp_path_factory, tiny_tokenizer):
    """make_model(name, **make_tiny_model kwargs) -> path; each name is built once per session."""
    from specdec.models.tiny import make_tiny_model

    built: dict[str, str] = {}

    def make(name: str, **kwargs) -> str:
        if name not in built:
            kwargs.setdefault("tokenizer", tiny_tokenizer)
            built[name] = str(make_tiny_model(tmp_path_factory.mktemp(name), **kwargs))
        return built[name]

    return make


@pytest.fixture(scope="session")
def llama_path(make_model) -> str:
    """The default target: Llama, GQA (4 query / 2 kv heads), untied, 2 layers."""
    return make_model("llama", arch="llama", initializer_range=0.05, random_norms_and_biases=True)


@pytest.fixture(scope="session")
def eagle_head_path(llama_path, tmp_path_factory) -> str:
    """A random EAGLE head for ``llama_path``, its matrices scaled up: drafts that differ from
    "repeat f_p"."""
    from specdec.models.eagle import init_head, save_head
    from specdec.models.loader import load_model

    head = init_head(load_model(llama_path, torch.float32, torch.device("cpu")), seed=1)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    out = tmp_path_factory.mktemp("eagle") / "head"
    save_head(head, out)
    return str(out)


@pytest.fixture(scope="session")
def bf16_llama_path(llama_path, tmp_path_factory) -> str:
    """``llama_path`` saved in bf16: a bf16 checkpoint, as most published ones are."""
    import transformers

    out = tmp_path_factory.mktemp("bf16_llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(llama_path).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def other_draft_path(make_model) -> str:
    """An unrelated draft (different seed, one layer): its guesses are mostly rejected."""
    return make_model("other_draft", arch="llama", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, seed=7)


@pytest.fixture(scope="session")
def noisy_draft_path(llama_path, tmp_path_factory) -> str:
    """The target's weights plus noise: guesses are often but not always right, so both the
    accept and the reject paths of verification run."""
    return perturbed_copy(llama_path, tmp_path_factory.mktemp("noisy_draft"), scale=0.1, seed=3)


def perturbed_copy(src: str, dst: Path, scale: float, seed: int) -> str:
    """Copy a checkpoint folder, adding ``scale * std(W) * N(0, 1)`` to every weight matrix."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for file in Path(dst).glob("*.safetensors"):
        weights = load_file(str(file))
        for name, w in weights.items():
            if w.dim() == 2:
                weights[name] = w + scale * w.std() * torch.randn(w.shape, generator=gen)
        save_file(weights, str(file), metadata={"format": "pt"})
    return str(dst)


def copy_with_eos(src: str, dst: Path, eos_token_id: int) -> str:
    """Copy a checkpoint whose generation_config names ``eos_token_id`` as an extra EOS."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    gen_file = Path(dst) / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen["eos_token_id"] = [eos_token_id]
    gen_file.write_text(json.dumps(gen))
    return str(dst)


def char_tokenizer(chars: str = "abcdefghijklmnopqrstuvwxyz "):
    """A character-level WordLevel tokenizer: 3 specials + one token per character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<eos>": 1, "<pad>": 2}
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    return list(PROMPTS)


# The helpers as fixtures, so test modules need not import this file.
@pytest.fixture(scope="session")
def make_perturbed_copy():
    return perturbed_copy


@pytest.fixture(scope="session")
def make_copy_with_eos():
    return copy_with_eos


@pytest.fixture(scope="session")
def make_char_tokenizer():
    return char_tokenizer


# A DeepSeek-R1 / Qwen3-style thinking template: the generation prompt opens the reasoning
# (`<think>\n`), or closes it at once when the caller passes enable_thinking=False.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant: <think>\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def thinking_model_path(tiny_tokenizer, tmp_path_factory) -> str:
    """A tiny Qwen3 whose tokenizer has `<think>` / `</think>` as single tokens and whose
    template thinks. A random model would never write `</think>`: its lm_head row is made a
    multiple of the row of a token greedy decoding of "def f(x):" picks a few steps in, so
    greedy decoding closes the reasoning after some thinking, and the answer follows."""
    import transformers
    from safetensors.torch import load_file, save_file

    from specdec.models.tiny import make_tiny_model

    base = tmp_path_factory.mktemp("thinking_tok")
    tiny_tokenizer.save_pretrained(base)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINKING_TEMPLATE
    out = make_tiny_model(tmp_path_factory.mktemp("thinking"), arch="qwen3", tokenizer=tok, seed=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "def f(x):"}], add_generation_prompt=True)
    ids = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])
    end = tok.convert_tokens_to_ids("</think>")
    head = model.lm_head.weight
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=12, do_sample=False).tolist()[0][ids.shape[1]:]
        for step, scale in ((s, c) for s in range(3, 10) for c in (1.1, 1.5, 2.0)):
            head[end] = scale * head[greedy[step]]
            new = model.generate(ids, max_new_tokens=12, do_sample=False).tolist()[0][ids.shape[1]:]
            if end in new and new.index(end) >= 3:
                break
        else:
            raise AssertionError("no lm_head row for </think> closes the reasoning after some thinking")
    file = next(Path(out).glob("*.safetensors"))
    weights = load_file(str(file))
    weights["lm_head.weight"][end] = head[end].clone()
    save_file(weights, str(file), metadata={"format": "pt"})
    return str(out)
