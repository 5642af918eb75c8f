"""llama.cpp as a peer: find its binaries and GGUF files, run ``llama-server`` / ``llama-bench``.

Every llama.cpp configuration runs through ``llama-server`` (one process per configuration, one
slot), posting each prompt's token ids to ``/completion``: the same prompts as the other engines,
and the same timing definition. The server's ``timings`` split prompt processing from generation
at the first token (``predicted_ms`` runs from the first token to the last; ``predicted_n`` counts
the first token too), so decode tokens/s = (predicted_n - 1) / predicted_ms, as in specdec's bench;
``predicted_per_second`` (llama.cpp's own figure, first token included) is kept beside it.
``llama-bench -p 0 -n N`` (decode from an empty context, no prompt) is a cross-check row.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specdec.bench.peers.configs import PeerConfig

SERVER, BENCH, QUANTIZE = "llama-server", "llama-bench", "llama-quantize"
# llama-server flags every configuration gets. A GGML_NATIVE build on an AMX CPU puts the quantized
# weights in ggml's AMX buffer type, whose tile matmul (prompt processing: more than one row) faults in
# ldtilecfg (general protection, the server dies with -11) on some AMX virtual machines; --no-repack keeps
# the weights in the plain CPU buffer. One-row decoding never reaches the tiles, so llama-bench's decode
# row keeps the default and stands beside it as the cross-check.
SERVER_ARGS = ("--no-repack",)


def peers_dir() -> Path:
    from specdec.models.hub import cache_dir

    return cache_dir() / "peers"


def find_bin_dir(explicit: str | None = None) -> tuple[Path | None, str]:
    """``--llama-cpp-dir``, else $SPECDEC_LLAMA_CPP, else llama-server on PATH, else the build of
    scripts/build_llama_cpp.sh. Returns (folder of the binaries or None, how it was found / why not)."""
    candidates = []
    if explicit:
        candidates.append((Path(explicit).expanduser(), "--llama-cpp-dir"))
    elif os.environ.get("SPECDEC_LLAMA_CPP"):
        candidates.append((Path(os.environ["SPECDEC_LLAMA_CPP"]).expanduser(), "$SPECDEC_LLAMA_CPP"))
    else:
        on_path = shutil.which(SERVER)
        if on_path:
            candidates.append((Path(on_path).parent, "PATH"))
        candidates.append((peers_dir() / "llama.cpp" / "build" / "bin", "scripts/build_llama_cpp.sh's build"))
    for folder, how in candidates:
        for sub in (folder, folder / "bin", folder / "build" / "bin"):
            if (sub / SERVER).is_file() and os.access(sub / SERVER, os.X_OK):
                return sub, how
    tried = ", ".join(str(f) for f, _ in candidates)
    return None, f"no {SERVER} found (tried {tried}; build one with scripts/build_llama_cpp.sh)"


def source_dir(bin_dir: Path | None) -> Path | None:
    """The llama.cpp source tree above build/bin (for convert_hf_to_gguf.py), if there is one."""
    if bin_dir is None:
        return None
    for up in (bin_dir.parent.parent, bin_dir.parent, peers_dir() / "llama.cpp"):
        if (up / "convert_hf_to_gguf.py").is_file():
            return up
    return None


def downloaded_gguf(model_dir: str) -> Path | None:
    """The GGUF that specdec converted ``model_dir`` from (its specdec_source.json), if still cached."""
    from specdec.models.hub import cache_dir

    marker = Path(model_dir) / "specdec_source.json"
    if not marker.is_file():
        return None
    name = json.loads(marker.read_text()).get("gguf_file")
    path = cache_dir() / "downloads" / name if name else None
    return path if path and path.is_file() else None


def converted_gguf(model_dir: str, kind: str, bin_dir: Path | None, log) -> tuple[Path | None, str | None]:
    """bf16 / Q8_0 GGUF of an HF folder, converted once into the peers cache. (path, why not)."""
    out_dir = peers_dir() / "gguf"
    name = Path(model_dir).name
    bf16, q8 = out_dir / f"{name}-bf16.gguf", out_dir / f"{name}-Q8_0.gguf"
    want = bf16 if kind == "bf16" else q8
    if want.is_file():
        return want, None
    src = source_dir(bin_dir)
    if src is None:
        return None, "no llama.cpp source tree with convert_hf_to_gguf.py next to the binaries"
    out_dir.mkdir(parents=True, exist_ok=True)
    # scripts/build_llama_cpp.sh puts sentencepiece, which the converter imports, in convert-site
    site = peers_dir() / "convert-site"
    if not bf16.is_file():
        log(f"converting {model_dir} to {bf16} (once)")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(src / "gguf-py"), str(site),
                                                                        os.environ.get("PYTHONPATH")])))
        r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), model_dir, "--outtype", "bf16",
                            "--outfile", str(bf16) + ".tmp"], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"convert_hf_to_gguf.py failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
        os.replace(str(bf16) + ".tmp", bf16)
    if kind == "q8_0" and not q8.is_file():
        if not (bin_dir / QUANTIZE).is_file():
            return None, f"no {QUANTIZE} in {bin_dir} to make the Q8_0 GGUF"
        log(f"quantizing {bf16} to {q8} (once)")
        r = subprocess.run([str(bin_dir / QUANTIZE), str(bf16), str(q8) + ".tmp", "Q8_0"], capture_output=True,
                           text=True)
        if r.returncode != 0:
            return None, f"llama-quantize failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
        os.replace(str(q8) + ".tmp", q8)
    return want, None


def server_command(bin_dir: Path, config: PeerConfig, ggufs: dict, port: int, threads: int, ctx: int) -> list[str]:
    opts = config.options
    cmd = [str(bin_dir / SERVER), "-m", str(ggufs[opts["gguf"]]), "-t", str(threads), "-tb", str(threads),
           "-c", str(ctx), "-np", "1", "-ngl", "0", "--host", "127.0.0.1", "--port", str(port), "--no-webui", *SERVER_ARGS]
    if opts.get("draft_gguf"):
        cmd += ["-md", str(ggufs["draft_" + opts["draft_gguf"]]), "-td", str(threads), "-tbd", str(threads)]
    return cmd + list(opts.get("server_args", []))


def bench_command(bin_dir: Path, config: PeerConfig, ggufs: dict, threads: int, output_len: int,
                  repetitions: int) -> list[str]:
    return [str(bin_dir / BENCH), "-m", str(ggufs[config.options["gguf"]]), "-p", "0", "-n", str(output_len),
            "-t", str(threads), "-r", str(repetitions), "-o", "json"]


def completion_request(prompt_ids: list[int], output_len: int) -> dict:
    return {"prompt": prompt_ids, "n_predict": output_len, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "stream": False}


def parse_completion(response: dict) -> dict:
    """One ``/completion`` response -> the per-prompt record the other engines produce."""
    t = response["timings"]
    n = int(t["predicted_n"])
    out = {"num_output_tokens": n, "num_decode_tokens": n - 1, "prefill_s": t["prompt_ms"] / 1e3,
           "decode_s": t["predicted_ms"] / 1e3, "llama_predicted_per_second": t.get("predicted_per_second")}
    if "draft_n" in t:
        out["draft_n"], out["draft_n_accepted"] = t["draft_n"], t.get("draft_n_accepted", 0)
    return out


def draft_acceptance(per_prompt: list[dict]) -> dict | None:
    drafted = sum(p.get("draft_n", 0) for p in per_prompt)
    if not drafted:
        return None
    return {"acceptance_rate": sum(p.get("draft_n_accepted", 0) for p in per_prompt) / drafted,
            "mean_acceptance_length": None}  # the server reports no per-request verification step count


def parse_bench(stdout: str) -> dict:
    """``llama-bench -o json`` -> tokens/s of the generation test (avg over its repetitions)."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("[")), None)
    if start is None:
        raise ValueError("llama-bench printed no JSON array")
    records = json.loads("\n".join(lines[start:]))
    gen = [r for r in records if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not gen:
        raise ValueError("llama-bench printed no generation-only record")
    r = gen[-1]
    return {"tokens_per_s": float(r["avg_ts"]), "samples_tokens_per_s": [float(x) for x in r.get("samples_ts", [])],
            "n_gen": r["n_gen"], "build_commit": r.get("build_commit"), "cpu_info": r.get("cpu_info")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama-server not healthy after {timeout:.0f} s")


def run_server(cmd: list[str], port: int, prompts: list[list[int]], output_len: int, log_path: Path,
               warmup_tokens: int = 16, timeout: float = 1800) -> dict:
    url = f"http://127.0.0.1:{port}"
    t = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, timeout=600)
            load_s = time.perf_counter() - t
            _post(url + "/completion", completion_request(prompts[0], warmup_tokens), timeout)  # untimed
            per_prompt = [parse_completion(_post(url + "/completion", completion_request(p, output_len), timeout))
                          for p in prompts]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"per_prompt": per_prompt, "acceptance": draft_acceptance(per_prompt), "load_s": load_s}


def run_bench(cmd: list[str], log_path: Path, timeout: float = 1800) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    log_path.write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    return parse_bench(r.stdout)
