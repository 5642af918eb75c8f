"""The ``specdec`` command line: a fresh tiny model end to end (subprocesses, as a user runs
it), and bad flag values: exit code 2 with a message that names the field."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.cli import main


def specdec_exe() -> str:
    exe = Path(sys.executable).with_name("specdec")
    return str(exe) if exe.exists() else shutil.which("specdec")


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([specdec_exe(), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    res = run_cli("demo", "make-tiny", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == str(out)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    return out


def test_make_tiny_then_generate_prints_the_text(cli_model):
    res = run_cli("generate", "--model", str(cli_model), "hello", "--max-tokens", "8")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stderr.strip().splitlines()[-1])
    assert info["finish_reason"] in ("length", "stop") and 1 <= info["generated_tokens"] <= 8
    # the streamed text is what the Python API returns for the same (greedy) request
    llm = LLM(model=str(cli_model), device="cpu")
    (want,) = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert res.stdout == want.outputs[0].text + "\n"
    assert info["generated_tokens"] == len(want.outputs[0].token_ids)


def test_bad_value_exits_2_naming_the_field(cli_model):
    res = run_cli("generate", "--model", str(cli_model), "hello", "--temperature", "-1")
    assert res.returncode == 2
    assert "temperature" in res.stderr and "-1" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("flags, field", [
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--speculative-config", "{not json"], "speculative_config"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'], "num_speculative_tokens"),
])
def test_bad_values_in_process(cli_model, capsys, flags, field):
    assert main(["generate", "--model", str(cli_model), "hi", "--device", "cpu", *flags]) == 2
    assert field in capsys.readouterr().err


def test_unparsable_value_is_an_argparse_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--max-tokens", "abc"])
    assert e.value.code == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_missing_model_folder_is_a_clean_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
