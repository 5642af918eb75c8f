"""A script that starts tensor-parallel ranks without the ``__main__`` guard fails at once with an
error that says so: each spawned rank re-imports the script, and would build an engine of its own.
(Guarded scripts and in-process engines with spawned ranks: tests/distributed.)"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    # a process-group timeout far beyond the bound below: only the early exit can meet it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_DIST_TIMEOUT": "300", "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400, env=env,
                         cwd=tmp_path)
    return res, time.monotonic() - started


def test_an_unguarded_tensor_parallel_script_fails_at_once_saying_why(llama_path, tmp_path):
    res, seconds = run_script(tmp_path, f"""
        from specdec import LLM

        llm = LLM(model={llama_path!r}, tensor_parallel_size=2, dtype="float32", device="cpu", max_model_len=64)
        print("engine built")
    """)
    assert res.returncode != 0 and "engine built" not in res.stdout
    last_error = res.stderr.strip().splitlines()[-1]
    assert last_error.startswith("RuntimeError: tensor_parallel_size > 1") and 'if __name__ == "__main__":' in last_error
    assert seconds < 120, seconds  # (the rank's start-up and the script's imports, twice; not the 300 s timeout)


def test_spawned_ranks_know_the_methods_registered_in_the_driver_and_take_their_controls(llama_path, prompts):
    """"replay" is registered by importing specdec.bench in this process only: the spawned rank
    imports the registering modules before it reads the config, and the control reaches it too."""
    import specdec.bench  # noqa: F401
    from specdec import LLM, SamplingParams
    from specdec.bench import driver

    engine = dict(dtype="float32", device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = [LLM(model=llama_path, **engine).tokenizer.encode(p) for p in prompts[:2]]
    plain = [o.outputs[0].token_ids for o in LLM(model=llama_path, **engine).generate(
        [{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)]
    llm = LLM(model=llama_path, tensor_parallel_size=2, **engine,
              speculative_config={"method": "replay", "acceptance": 1.0, "num_speculative_tokens": 3})
    try:
        assert driver.register_references(llm, ids, plain)
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain
        metrics = llm.get_metrics()
        assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"] > 0  # the rank replayed them too
    finally:
        llm.engine.executor.shutdown()
