#!/usr/bin/env bash
# Build llama.cpp (a benchmark peer, never a dependency of specdec) from the source that the
# llama-cpp-python sdist on PyPI vendors, into ~/.cache/specdec/peers/llama.cpp/build/bin.
# Then (optional, cached) convert Qwen2.5-Coder-1.5B-Instruct to bf16 and Q8_0 GGUFs for
# `specdec bench peers`.
#
#   scripts/build_llama_cpp.sh                  # build + GGUF conversion
#   SKIP_GGUF=1 scripts/build_llama_cpp.sh      # build only
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 JOBS=2 PEERS_DIR=... scripts/build_llama_cpp.sh
#
# On 2 cores the build takes ~25-40 minutes; run it niced in the background:
#   nice -n 10 scripts/build_llama_cpp.sh > /tmp/build_llama_cpp.log 2>&1 &
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-$HOME/.cache/specdec/peers}
SRC=$PEERS_DIR/llama.cpp
JOBS=${JOBS:-2}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-}
PY=${PYTHON:-python}
MODELS_DIR=${SPECDEC_MODELS_DIR:-$HOME/.cache/specdec/models}
GGUF_DIR=$PEERS_DIR/gguf
TARGETS=(llama-server llama-bench llama-quantize llama-cli)

mkdir -p "$PEERS_DIR/sdist"
t0=$(date +%s)

# 1. the sdist (cached)
sdist=$(ls "$PEERS_DIR"/sdist/llama_cpp_python-${VERSION}*.tar.gz 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$sdist" ]; then
  spec=llama-cpp-python${VERSION:+==$VERSION}
  echo "[build_llama_cpp] pip download --no-binary :all: --no-deps $spec"
  "$PY" -m pip download --no-binary :all: --no-deps "$spec" -d "$PEERS_DIR/sdist"
  sdist=$(ls "$PEERS_DIR"/sdist/llama_cpp_python-*.tar.gz | sort -V | tail -1)
fi
echo "[build_llama_cpp] sdist: $sdist"

# 2. its vendored llama.cpp -> $SRC
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  tmp=$(mktemp -d "$PEERS_DIR/extract.XXXX")
  tar xzf "$sdist" -C "$tmp"
  rm -rf "$SRC"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$SRC"
  basename "$sdist" > "$SRC/SPECDEC_SDIST"
  rm -rf "$tmp"
fi

# 3. cmake build (Release, native CPU, no curl), only the tools the benchmark uses
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
  -DBUILD_SHARED_LIBS=OFF
cmake --build "$SRC/build" --config Release -j "$JOBS" --target "${TARGETS[@]}"
t1=$(date +%s)
echo "[build_llama_cpp] built in $((t1 - t0)) s: $SRC/build/bin"
ls -la "$SRC/build/bin"

# 4. bf16 and Q8_0 GGUFs of the target (cached). convert_hf_to_gguf.py imports sentencepiece even
# for BPE vocabularies: it goes into a folder of its own put on this python's path for the
# conversion only (this python's packages, torch included, left as they are); `specdec bench
# peers` converts with that folder too.
if [ "${SKIP_GGUF:-0}" != 1 ]; then
  mkdir -p "$GGUF_DIR"
  CSITE=$PEERS_DIR/convert-site
  if ! PYTHONPATH="$CSITE" "$PY" -c "import sentencepiece" 2>/dev/null; then
    "$PY" -m pip install -q --target "$CSITE" sentencepiece
  fi
  for name in ${GGUF_MODELS:-Qwen2.5-Coder-1.5B-Instruct}; do
    hf=$MODELS_DIR/$name
    bf16=$GGUF_DIR/$name-bf16.gguf
    q8=$GGUF_DIR/$name-Q8_0.gguf
    if [ ! -d "$hf" ]; then echo "[build_llama_cpp] no $hf: skipping its GGUFs"; continue; fi
    if [ ! -f "$bf16" ]; then
      PYTHONPATH="$SRC/gguf-py:$CSITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$SRC/convert_hf_to_gguf.py" \
        "$hf" --outtype bf16 --outfile "$bf16.tmp" && mv "$bf16.tmp" "$bf16"
    fi
    if [ ! -f "$q8" ]; then
      "$SRC/build/bin/llama-quantize" "$bf16" "$q8.tmp" Q8_0 && mv "$q8.tmp" "$q8"
    fi
  done
  ls -la "$GGUF_DIR"
fi
echo "[build_llama_cpp] done in $(( $(date +%s) - t0 )) s"
