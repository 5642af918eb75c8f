"""Run one configuration of one engine in its own process and return its figures.

Each engine's run yields either per-prompt records (batch 1: ``num_decode_tokens`` and
``decode_s`` per prompt) or one batch record (``num_output_tokens`` over ``wall_s``); ``tokens_per_s``
turns either into the table's figure: decode tokens/s = all prompts' decode tokens over their
decode time (every prompt makes the same number of tokens, so this is the harmonic mean of the
per-prompt rates), batch tokens/s = output tokens over the batch's wall time (prefill included).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.peers import llama_cpp
from specdec.bench.peers.configs import LLAMA_CPP, SPECDEC, VLLM, PeerConfig, substitute

RESULT_PREFIX = "PEER_RESULT "
VLLM_WORKER = Path(__file__).with_name("vllm_worker.py")


@dataclass
class Setup:
    """Everything a run needs besides its configuration (found once per ``specdec bench peers``)."""
    target: str  # HF folder
    draft: str  # HF folder
    threads: int
    cpus: str  # "0-1": vLLM's OMP binding
    output_len: int
    max_model_len: int
    log_dir: Path
    vllm_python: str | None = None
    vllm_kvcache_gib: int = 2
    llama_bin: Path | None = None
    ggufs: dict | None = None
    timeout_s: float = 3600


def tokens_per_s(result: dict) -> float:
    if "per_prompt" in result:
        pp = result["per_prompt"]
        return sum(p["num_decode_tokens"] for p in pp) / sum(p["decode_s"] for p in pp)
    return result["num_output_tokens"] / result["wall_s"]


def parse_worker_output(stdout: str) -> dict:
    """The last ``PEER_RESULT {json}`` line a worker printed."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise ValueError("the worker printed no PEER_RESULT line")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def job(config: PeerConfig, setup: Setup, prompts: list[list[int]], batch_size: int) -> dict:
    """A worker's job; ``options["model"]`` (``{target_q4_k_m}``: the target's GGUF) replaces the target."""
    ggufs = setup.ggufs or {}
    names = {"draft": setup.draft, "target_q4_k_m": ggufs.get("q4_k_m"), "draft_q4_k_m": ggufs.get("draft_q4_k_m")}
    options = substitute(config.options, {k: str(v) for k, v in names.items()})
    options.pop("draft_gguf", None)
    return {"model": options.pop("model", setup.target), "options": options,
            "prompts": prompts, "output_len": setup.output_len, "batch_size": batch_size,
            "num_threads": setup.threads, "max_model_len": setup.max_model_len}


def worker_command(config: PeerConfig, setup: Setup, job_path: Path) -> tuple[list[str], dict]:
    """The command line and environment of a specdec or vLLM worker process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(setup.threads))
    if config.engine == SPECDEC:
        return [sys.executable, "-m", "specdec.bench.peers.specdec_worker", str(job_path)], env
    if config.engine == VLLM:
        env.update(VLLM_CPU_KVCACHE_SPACE=str(setup.vllm_kvcache_gib), VLLM_CPU_OMP_THREADS_BIND=setup.cpus,
                   VLLM_TARGET_DEVICE="cpu")
        env.pop("PYTHONPATH", None)  # the venv's own packages only
        return [str(setup.vllm_python), str(VLLM_WORKER), str(job_path)], env
    raise ValueError(f"no worker process for engine {config.engine!r}")


def run_config(config: PeerConfig, setup: Setup, prompts: list[list[int]], batch_size: int, tag: str) -> dict:
    """One run: the engine's result dict plus ``tokens_per_s``; raises on failure (the log says why)."""
    log = setup.log_dir / f"{tag}.log"
    if config.engine == LLAMA_CPP:
        if batch_size != 1:
            raise ValueError("llama.cpp runs batch 1 only here")
        if config.options.get("tool") == "llama-bench":
            out = llama_cpp.run_bench(llama_cpp.bench_command(setup.llama_bin, config, setup.ggufs, setup.threads,
                                                              setup.output_len, 3), log, setup.timeout_s)
            return {**out, "acceptance": None}
        port = llama_cpp.free_port()
        cmd = llama_cpp.server_command(setup.llama_bin, config, setup.ggufs, port, setup.threads, setup.max_model_len)
        out = llama_cpp.run_server(cmd, port, prompts, setup.output_len, log, timeout=setup.timeout_s)
        return {**out, "tokens_per_s": tokens_per_s(out), "command": cmd}
    job_path = setup.log_dir / f"{tag}.job.json"
    job_path.write_text(json.dumps(job(config, setup, prompts, batch_size)))
    cmd, env = worker_command(config, setup, job_path)
    with open(log, "w") as f:
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=setup.timeout_s)
        f.write("\n--- stdout ---\n" + r.stdout)
    if r.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"exit {r.returncode}: {' | '.join(tail)}")
    out = parse_worker_output(r.stdout)
    return {**out, "tokens_per_s": tokens_per_s(out)}


def probe_vllm(python: str | None, timeout: float = 600) -> tuple[str | None, str]:
    """(vLLM version, how found) if ``python`` imports vllm, else (None, why not)."""
    if not python:
        return None, "no vLLM python (--vllm-python, $SPECDEC_VLLM_PYTHON, /work/venvs/vllm-cpu/bin/python)"
    if not Path(python).is_file():
        return None, f"{python} does not exist"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    try:
        r = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"{python} -c 'import vllm' took over {timeout:.0f} s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} cannot import vllm: {last}"
    return r.stdout.strip().splitlines()[-1], python


DEFAULT_VLLM_PYTHON = "/work/venvs/vllm-cpu/bin/python"


def default_vllm_python() -> str | None:
    if os.environ.get("SPECDEC_VLLM_PYTHON"):
        return os.environ["SPECDEC_VLLM_PYTHON"]
    return DEFAULT_VLLM_PYTHON if Path(DEFAULT_VLLM_PYTHON).is_file() else None
