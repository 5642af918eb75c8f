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
