#!/usr/bin/env bash
# The commands behind every number in BENCHMARKS.md. Each writes bench_results/NAME.json;
# scripts/make_benchmarks_md.py then rebuilds BENCHMARKS.md from those files.
#
#   scripts/bench_all.sh            # everything (about an hour on 2 CPU cores)
#   scripts/bench_all.sh latency    # one group: latency | throughput | sweep | compare
#
# The checkpoints are random (speed does not depend on weight values) and live outside the
# repository: a TinyLlama-1.1B-shaped Llama in bf16 and a 1-layer draft cut from it.
set -euo pipefail
cd "$(dirname "$0")/.."

# On a shared machine the OpenMP pool must sleep, not spin, while it waits: with the default
# policy one descheduled thread stalls every parallel region (measured here: 1.6 s vs 0.18 s
# per 1B decode step at load ~4 on 2 cores). Recorded in every JSON under machine.env.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

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

$PYTHON scripts/make_benchmarks_md.py
