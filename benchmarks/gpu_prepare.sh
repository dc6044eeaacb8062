#!/usr/bin/env bash
# Prepares what benchmarks/gpu_check.sh needs on a GPU machine that reaches no package registry (this workplace's
# device machines: Python 3.12, with torch (CUDA), transformers, triton, numpy, psutil, tokenizers, safetensors and
# pytest already there): the wheels of pagedllm's other dependencies in .whl/, and the default model's GGUF in
# .gpu/, split in two parts of under 64 MiB, since one call carries at most 64 MiB. Both folders are kept out of git.
#
#   bash benchmarks/gpu_prepare.sh
#   then, on the device: a first call carrying .gpu/part-1 (command: true), which stays on the warm machine;
#   at once a second carrying .gpu/part-2 and .whl with: bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude || echo /.gpu/ >> .git/info/exclude
rm -rf .whl .gpu && mkdir -p .whl .gpu
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    msgspec gguf pyzmq 'pydantic>=2' pydantic-core annotated-types typing-inspection 'xgrammar>=0.2.9,<0.3' \
    apache-tvm-ffi prometheus_client typing-extensions
gguf_file=$(.venv/bin/python -c 'from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
print(resolve_model(DEFAULT_MODEL))')
split -n 2 -d "$gguf_file" .gpu/part-
mv .gpu/part-00 .gpu/part-1 && mv .gpu/part-01 .gpu/part-2
du -sh .whl .gpu/part-1 .gpu/part-2
