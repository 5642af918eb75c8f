#!/usr/bin/env bash
# One-shot check on a single GPU (NVIDIA or AMD), under 8 minutes:
#   1. the kernel tests compiled for the device (no interpreter), SPECDEC_KERNEL_DEVICE=cuda;
#   2. a benchmark on a random-weight Llama-3-8B-shaped model (bf16, initialised on the GPU):
#      HBM bandwidth (large copy, best of several), forward cost for 1..9 query rows with a
#      512-token KV context (CUDA graphs when capture works), decode tokens/s at batch 1 and
#      its fraction of the weight-streaming roofline, transformers `generate` tokens/s, and,
#      through specdec's public API (`LLM`), plain decode and "replay" speculation
#      (acceptance 0.8, K=5) against the Leviathan et al. bound;
#   3. speculation on the same checkpoint through specdec's model runner (scripts/gpu_check_spec.py):
#      a 24-node token-tree step and a K=5 chain step against a decode step (batch 1 and 8, eager
#      and from graphs), the tree attention kernel against the torch path, a draft step with fp8
#      weights against bf16 (Llama-3.2-1B shape), and an EAGLE head's step against the target's.
# Prints one short table last; writes JSON to $OUT/gpu_check.json ($OUT unset: ./gpu_check.json).
#
#   scripts/gpu_check.sh
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_PRESET=tiny GPU_CHECK_SKIP_TESTS=1 scripts/gpu_check.sh   # dry run
# Env: GPU_CHECK_PRESET=llama3-8b|llama3-1b|tiny, GPU_CHECK_SKIP_ENGINE=1, GPU_CHECK_SKIP_TESTS=1,
#      GPU_CHECK_PHASES=name,name (run only these benchmark phases; a phase another needs, such
#      as build_model and save_checkpoint for engine, must be listed too),
#      PYTHON (default: .venv/bin/python if present, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=$(command -v python3 || command -v python); fi
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'hip', torch.version.hip, 'gpu', torch.cuda.is_available())"
RESULTS=${OUT:-.}
mkdir -p "$RESULTS"
export GPU_CHECK_RESULTS="$RESULTS"
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
unset TRITON_INTERPRET
START=$(date +%s)
export GPU_CHECK_DEADLINE=$(( START + 460 ))  # phases that would not finish by then are skipped

# ---------------------------------------------------------------- 1. kernel tests on the device
if [ "${GPU_CHECK_SKIP_TESTS:-0}" != "1" ]; then
  echo "== kernel tests (compiled for the device) =="
  # the C++ CPU kernels (tests/kernels/cpu) have no GPU form: their tests run on CI
  SPECDEC_KERNEL_DEVICE=cuda timeout 200 "$PY" -m pytest tests/kernels/triton -q -p no:cacheprovider \
    tests/worker/test_graph_runner.py tests/worker/test_runner_graphs.py tests/worker/test_runner_tree_graphs.py \
    tests/worker/test_engine_eagle_graphs.py tests/worker/test_engine_tree_graphs.py \
    --durations=5 2>&1 | tee "$RESULTS/kernel_tests.txt" | tail -25
  echo "rc=${PIPESTATUS[0]}" >> "$RESULTS/kernel_tests.txt"
fi
export GPU_CHECK_TEST_SECONDS=$(( $(date +%s) - START ))

# ---------------------------------------------------------------- 2. benchmark
timeout $(( 470 - GPU_CHECK_TEST_SECONDS )) "$PY" - <<'PYEOF'
import gc, json, os, re, shutil, tempfile, time, traceback

import torch

results_dir = os.environ["GPU_CHECK_RESULTS"]
json_path = os.path.join(results_dir, "gpu_check.json")
device = torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
preset = os.environ.get("GPU_CHECK_PRESET", "llama3-8b" if device.type == "cuda" else "tiny")
R = {"kind": "gpu_check", "preset": preset, "device": str(device), "torch": torch.__version__, "hip": torch.version.hip,
     "cuda": torch.version.cuda, "errors": {}}
if device.type == "cuda":
    R["gpu"] = torch.cuda.get_device_name(device)
try:
    import triton
    R["triton"] = triton.__version__
except ImportError:
    R["triton"] = None


def save():
    with open(json_path, "w") as f:
        json.dump(R, f, indent=1, default=str)


ONLY = {p for p in os.environ.get("GPU_CHECK_PHASES", "").split(",") if p}


def phase(name):
    """Run a benchmark phase; a failure is recorded and the script goes on."""
    def wrap(fn):
        if ONLY and name not in ONLY:
            R.setdefault("skipped", {})[name] = "not in GPU_CHECK_PHASES"
            return
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report and continue
            R["errors"][name] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
        save()
    return wrap


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn, iters, warmup=2, best=False):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times) if best else sorted(times)[len(times) // 2]


# ---- kernel test summary (from step 1)
test_log = os.path.join(results_dir, "kernel_tests.txt")
if os.path.exists(test_log):
    text = open(test_log).read()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    rc = re.search(r"rc=(\d+)", text)
    R["kernel_tests"] = {**counts, "rc": int(rc.group(1)) if rc else None,
                         "seconds": int(os.environ.get("GPU_CHECK_TEST_SECONDS", 0))}
save()


@phase("hbm_bandwidth")
def _():
    n = (1 << 30) if device.type == "cuda" else (1 << 24)  # 4 GiB of fp32 per buffer on the GPU
    a = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    t = seconds_per_call(lambda: b.copy_(a), iters=10, best=True)
    R["hbm_bandwidth_gbs"] = 2 * a.numel() * 4 / t / 1e9  # read + write
    del a, b


PRESETS = {  # Llama-3-8B / Llama-3.2-1B shapes
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8),
    "llama3-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
CONTEXT = 512
state = {}


def crop_to(cache, length):
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # negative = tokens to remove, in transformers 4.x and 5.x alike


@phase("build_model")
def _():
    import transformers
    cfg = transformers.LlamaConfig(**{"max_position_embeddings": 8192, "rope_theta": 500000.0,
                                      "tie_word_embeddings": False, **PRESETS[preset]})
    cfg.eos_token_id = None  # random weights: never stop early
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # larger logits: greedy is not a near-tie
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    R["model"] = {"params_b": sum(p.numel() for p in model.parameters()) / 1e9, "weight_gb": weight_bytes / 1e9}
    if "hbm_bandwidth_gbs" in R:
        # a decode step streams every weight once (embedding rows aside): the batch-1 ceiling
        R["roofline_decode_tok_s"] = R["hbm_bandwidth_gbs"] * 1e9 / weight_bytes
    state["model"], state["config"] = model, cfg


@phase("hf_forward_rows")
def _():
    """Forward cost of q = 1..9 query rows over a CONTEXT-token cache: what verifying K = q-1
    drafts costs relative to one decode step. CUDA graphs remove launch overhead, so this is
    the device's cost; eager timings are kept when capture fails."""
    from transformers import DynamicCache
    model, vocab = state["model"], state["config"].vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, CONTEXT), generator=gen).to(device)
    cache = DynamicCache()
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
    ms, mode = {}, {}
    for rows in range(1, 10):
        ids = torch.randint(0, vocab, (1, rows), generator=gen).to(device)

        def forward():
            with torch.no_grad():
                model(ids, past_key_values=cache, use_cache=True)
            crop_to(cache, CONTEXT)

        eager = seconds_per_call(forward, iters=5)
        t, mode[rows] = eager, "eager"
        if device.type == "cuda":
            try:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    forward()
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.no_grad(), torch.cuda.graph(graph):
                    model(ids, past_key_values=cache, use_cache=True)  # replays read the CONTEXT-token cache
                crop_to(cache, CONTEXT)
                t, mode[rows] = seconds_per_call(graph.replay, iters=20), "graph"
                del graph
            except Exception as e:  # noqa: BLE001
                R["errors"].setdefault("hf_graph_capture", f"{type(e).__name__}: {e}"[:300])
                crop_to(cache, CONTEXT)
        ms[rows] = t * 1e3
        R.setdefault("hf_forward_eager_ms", {})[rows] = eager * 1e3
    R["hf_forward_ms"] = ms
    R["hf_forward_mode"] = mode
    R["verify_cost_vs_decode"] = {rows: ms[rows] / ms[1] for rows in ms}
    R["hf_decode_tok_s"] = 1e3 / ms[1]
    if "roofline_decode_tok_s" in R:
        R["hf_decode_roofline_fraction"] = R["hf_decode_tok_s"] / R["roofline_decode_tok_s"]


@phase("hf_generate")
def _():
    model, vocab = state["model"], state["config"].vocab_size
    new_tokens = 128 if device.type == "cuda" else 16
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(1)).to(device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    with torch.no_grad():
        model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm up
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        sync()
    R["hf_generate_tok_s"] = (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


# ---------------------------------------------------------------- engine part (needs specdec)
@phase("save_checkpoint")
def _():
    from specdec.models.tiny import make_tokenizer
    model = state.pop("model")
    ckpt = state["ckpt"] = tempfile.mkdtemp(prefix="specdec_gpu_check_", dir=os.environ.get("GPU_CHECK_TMP"))
    t0 = time.time()
    model.config.dtype = "bfloat16"
    model.save_pretrained(ckpt)
    make_tokenizer(320).save_pretrained(ckpt)
    R["checkpoint_save_s"] = time.time() - t0
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@phase("engine")
def _():
    if os.environ.get("GPU_CHECK_SKIP_ENGINE") == "1":
        R["engine"] = {"skipped": "GPU_CHECK_SKIP_ENGINE=1"}
        return
    try:
        from specdec import LLM, SamplingParams
    except ImportError as e:
        R["engine"] = {"skipped": f"specdec.LLM not importable: {e}"}
        return
    ckpt = state["ckpt"]
    engine = R["engine"] = {}
    acceptance, k = 0.8, 5
    t0 = time.time()
    import specdec.bench  # noqa: F401  (registers the "replay" method)
    llm = LLM(model=ckpt, dtype="bfloat16", device=device.type, max_model_len=2048, seed=0,
              gpu_memory_utilization=0.6,
              speculative_config={"method": "replay", "acceptance": acceptance, "num_speculative_tokens": k})
    engine["load_s"] = time.time() - t0
    try:
        engine["attention_backend"] = llm.engine.runtime_plan.attention_backend
    except Exception as e:  # noqa: BLE001 - informational only
        engine["attention_backend"] = f"{llm.config.attention_backend} ({type(e).__name__})"
    prompt = list(range(3, 3 + 64))
    max_tokens = 256 if device.type == "cuda" else 24
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, use_speculation=False)
    spec_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    counters = ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
                "time_drafting_s", "time_target_s", "time_sampling_s")

    def timed_generate(params, name):
        before = llm.get_metrics()
        sync()
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        sync()
        t = time.perf_counter() - t
        after = llm.get_metrics()
        engine.setdefault("runs", {})[name] = {"seconds": t, **{c: after.get(c, 0) - before.get(c, 0) for c in counters}}
        return out, t

    # warm-up runs: Triton compiles, graph captures, first-use calibration. Replay proposes the
    # target's own greedy continuation, corrupted per token with probability 1 - acceptance, and
    # follows it only while the output agrees, so the reference is a warm plain run's output
    # (the first run can take other kernels); the draft costs ~nothing (c = 0 in the bound)
    first, engine["first_plain_s"] = timed_generate(plain, "first_plain")
    reference, _ = timed_generate(plain, "second_plain")
    engine["first_plain_equals_second"] = list(first.token_ids) == list(reference.token_ids)
    llm.engine.executor.control_proposer("set_references", [(prompt, list(reference.token_ids))])
    _, engine["first_spec_s"] = timed_generate(spec_params, "first_spec")
    out, t = timed_generate(plain, "plain")
    engine["decode_tok_s"] = len(out.token_ids) / t
    if "roofline_decode_tok_s" in R:
        engine["decode_roofline_fraction"] = engine["decode_tok_s"] / R["roofline_decode_tok_s"]
    spec_out, t = timed_generate(spec_params, "spec")
    engine["replay_tok_s"] = len(spec_out.token_ids) / t
    # lossless: greedy speculation must reproduce plain greedy decoding (bf16 near-ties aside)
    engine["replay_equals_plain"] = list(spec_out.token_ids) == list(out.token_ids)
    engine["speedup"] = engine["replay_tok_s"] / engine["decode_tok_s"]
    spec_run = engine["runs"]["spec"]
    engine["spec_steps"], engine["spec_drafts"] = spec_run["num_steps"], spec_run["num_drafts"]
    engine["spec_ms_per_step"] = spec_run["seconds"] / max(1, spec_run["num_steps"]) * 1e3
    engine["plain_ms_per_step"] = engine["runs"]["plain"]["seconds"] / max(1, engine["runs"]["plain"]["num_steps"]) * 1e3
    bound = (1 - acceptance ** (k + 1)) / (1 - acceptance)  # tokens per target step, c = 0
    engine["bound_tokens_per_step"] = bound
    engine["system_efficiency"] = engine["speedup"] / bound
    metrics = llm.get_metrics()
    engine["metrics"] = {key: v for key, v in metrics.items() if isinstance(v, (int, float, str))}


# ---------------------------------------------------------------- speculation phases (gpu_check_spec.py)
import sys
sys.path.insert(0, "scripts")
import gpu_check_spec  # noqa: E402

if "ckpt" in state:
    try:
        gpu_check_spec.run_phases(R, state, device, preset, PRESETS, phase, seconds_per_call,
                                  float(os.environ["GPU_CHECK_DEADLINE"]))
    finally:
        shutil.rmtree(state["ckpt"], ignore_errors=True)


# ---------------------------------------------------------------- summary table (last output)
rows = gpu_check_spec.report_rows(R)
save()
print(f"\nwrote {json_path}; errors: {sorted(R['errors']) or 'none'}")
print("\n" + "\n".join(f"{name:30s} {value}" for name, value in rows))
PYEOF
