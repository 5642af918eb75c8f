"""Loader errors a user can cause: each is one ValueError that names the problem."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec import LLM
from specdec.models.loader import load_config, load_model

ENGINE = dict(dtype="float32", device="cpu")


@pytest.fixture
def model_copy(llama_path, tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(llama_path, dst)
    return dst


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_loads_and_reports_the_architecture(llama_path):
    model = load_model(llama_path, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any(p.is_meta for p in model.parameters())


def test_unknown_architecture_names_it_and_the_supported_ones(model_copy):
    edit_config(model_copy, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as e:
        load_config(str(model_copy))
    assert "LlamaForCausalLM" in str(e.value)  # lists what is supported
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(model=str(model_copy), **ENGINE)


def test_model_type_transformers_does_not_know(model_copy):
    edit_config(model_copy, model_type="no_such_model_type")
    with pytest.raises(ValueError, match="no_such_model_type"):
        load_config(str(model_copy))


def test_missing_config_json(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(model_copy), **ENGINE)


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"), **ENGINE)


def test_missing_weights(model_copy):
    for f in model_copy.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        LLM(model=str(model_copy), **ENGINE)


def test_missing_shard_listed_in_the_index(make_model, tmp_path):
    src = make_model("loader_sharded", arch="llama", max_shard_size="40KB")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    shards = sorted(dst.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ValueError, match=shards[-1].name):
        load_model(str(dst), torch.float32, torch.device("cpu"))


def test_missing_tensor_is_named(model_copy):
    file = model_copy / "model.safetensors"
    weights = load_file(str(file))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(model_copy), torch.float32, torch.device("cpu"))


def test_missing_part_of_a_fused_weight_is_named(model_copy):
    file = model_copy / "model.safetensors"
    weights = load_file(str(file))
    del weights["model.layers.0.self_attn.v_proj.weight"]
    save_file(weights, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.0\.self_attn\.qkv_proj"):
        load_model(str(model_copy), torch.float32, torch.device("cpu"))


def test_shape_mismatch_names_the_weight_and_both_shapes(model_copy):
    edit_config(model_copy, intermediate_size=96)  # checkpoint has 128
    with pytest.raises(ValueError, match=r"shape mismatch for weight '.*mlp\..*'") as e:
        LLM(model=str(model_copy), **ENGINE)
    assert "128" in str(e.value) and "96" in str(e.value)


def test_unexpected_weight_is_named(model_copy):
    file = model_copy / "model.safetensors"
    weights = load_file(str(file))
    weights["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="extra_proj"):
        load_model(str(model_copy), torch.float32, torch.device("cpu"))


def test_a_model_larger_than_memory_is_refused_before_loading(llama_path, monkeypatch):
    from specdec.models import loader, memory_check
    from specdec.worker.model_runner import ModelRunner

    files = loader.safetensors_files(llama_path)
    weights = memory_check.checkpoint_weight_bytes(files, torch.float32)
    numel = sum(t.numel() for f in files for t in load_file(f).values())
    assert weights == 4 * numel  # float32: 4 bytes per weight whatever the checkpoint stores
    assert memory_check.checkpoint_weight_bytes(files, torch.bfloat16) == 2 * numel
    monkeypatch.setattr(memory_check, "available_memory_bytes", lambda: weights // 2)
    monkeypatch.setattr("specdec.worker.setup.load_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match="does not fit in memory") as e:
        LLM(model=llama_path, max_model_len=64, **ENGINE)
    cfg = load_config(llama_path)
    # max_model_len and the bonus slot in 16-token blocks
    min_kv = -(-65 // 16) * ModelRunner.kv_bytes_per_block(cfg, 16, torch.float32)
    message = str(e.value)
    assert f"{weights} bytes of weights in float32" in message
    assert f"{weights + min_kv} bytes" in message and f"{weights // 2} bytes are available" in message


def test_a_model_that_fits_loads(llama_path, monkeypatch):
    from specdec.models import memory_check

    monkeypatch.setattr(memory_check, "available_memory_bytes", lambda: 1 << 40)
    llm = LLM(model=llama_path, max_model_len=64, **ENGINE)
    assert llm.generate(["hi"])[0].outputs
