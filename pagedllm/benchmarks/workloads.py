"""The benchmark workloads W1–W3, the same prompts the vLLM-CPU, transformers and llama.cpp baselines were
measured on (docs/benchmarks.md).

Token ids are uniform in [100, vocab - 100) from numpy's PCG64 seeded by SeedSequence(0, spawn_key=(k,)),
k = 1, 2, 3 for W1, W2, W3; greedy, ignore_eos, exact output lengths. The fingerprints below are the ones
the baselines' harnesses printed, so a matching fingerprint proves the prompts are identical.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

VOCAB_SIZE = 49152
ID_LOW, ID_HIGH_MARGIN = 100, 100
FINGERPRINTS = {"W1": "6e151a74031cc894", "W2": "da5e7cf7f848e0bd", "W3": "52a8391ccdd8dcf7"}


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def output_tokens(self) -> int:
        return self.max_tokens * len(self.prompts)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(np.asarray(p, dtype=np.int64).tobytes())
            h.update(b"|")
        h.update(str(self.max_tokens).encode())
        return h.hexdigest()[:16]


def _rng(k: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(entropy=0, spawn_key=(k,)))


def _draw(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return [int(x) for x in rng.integers(ID_LOW, vocab_size - ID_HIGH_MARGIN, size=n, dtype=np.int64)]


def random_workload(name: str, num_prompts: int, input_len: int, output_len: int, prefix_len: int = 0,
                    vocab_size: int = VOCAB_SIZE, seed_key: int = 1) -> Workload:
    """num_prompts prompts of prefix_len shared + input_len unique tokens (the W1–W3 recipe, any shape)."""
    rng = _rng(seed_key)
    prefix = _draw(rng, prefix_len, vocab_size) if prefix_len else []
    return Workload(name, [prefix + _draw(rng, input_len, vocab_size) for _ in range(num_prompts)], output_len)


def shared_workloads(vocab_size: int = VOCAB_SIZE) -> dict[str, Workload]:
    return {
        "W1": random_workload("W1", 64, 256, 128, vocab_size=vocab_size, seed_key=1),
        "W2": random_workload("W2", 1, 32, 256, vocab_size=vocab_size, seed_key=2),
        "W3": random_workload("W3", 32, 16, 32, prefix_len=1024, vocab_size=vocab_size, seed_key=3),
    }


# W4, input-grounded: each request asks for its prompt's code back with one variable renamed, so most of the
# output quotes the prompt (what n-gram and suffix speculation are for). Functions are assembled from fixed parts
# by request index, so the prompts are the same in every run; they become token ids through the model's chat
# template, as a chat client's would.
_W4_FUNCTIONS = [
    ("moving_average", ["values", "window"], "total", [
        "result = []", "total = 0.0", "for index, value in enumerate(values):", "    total += value",
        "    if index >= window:", "        total -= values[index - window]", "    if index >= window - 1:",
        "        result.append(total / window)", "return result"]),
    ("word_counts", ["text", "minimum"], "counts", [
        "counts = {}", "for word in text.lower().split():", "    word = word.strip('.,;:!?')",
        "    if word:", "        counts[word] = counts.get(word, 0) + 1",
        "frequent = {w: c for w, c in counts.items() if c >= minimum}",
        "return sorted(frequent.items(), key=lambda item: (-item[1], item[0]))"]),
    ("merge_intervals", ["intervals"], "merged", [
        "merged = []", "for start, end in sorted(intervals):", "    if merged and start <= merged[-1][1]:",
        "        merged[-1][1] = max(merged[-1][1], end)", "    else:", "        merged.append([start, end])",
        "return [tuple(interval) for interval in merged]"]),
    ("binary_search", ["items", "target"], "middle", [
        "low, high = 0, len(items) - 1", "while low <= high:", "    middle = (low + high) // 2",
        "    if items[middle] == target:", "        return middle", "    if items[middle] < target:",
        "        low = middle + 1", "    else:", "        high = middle - 1", "return -1"]),
]
_W4_NEW_NAMES = ["running_sum", "accumulator", "partial", "current"]


def grounded_prompt(index: int) -> str:
    """The W4 request ``index``: one function to repeat with a variable renamed."""
    name, params, variable, body = _W4_FUNCTIONS[index % len(_W4_FUNCTIONS)]
    new_name = _W4_NEW_NAMES[(index // len(_W4_FUNCTIONS)) % len(_W4_NEW_NAMES)]
    code = f"def {name}({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in body)
    return (f"Repeat this Python code exactly, with the variable `{variable}` renamed to `{new_name}`. Output "
            f"only the code.\n\n{code}")


def grounded_workloads(tokenizer) -> dict[str, Workload]:
    """W4 (one stream) and W4-8 (eight at once), 128 output tokens each, tokenized with ``tokenizer``."""
    def prompts(n: int) -> list[list[int]]:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": grounded_prompt(i)}],
                                               add_generation_prompt=True, tokenize=False) for i in range(n)]
        return [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return {"W4": Workload("W4", prompts(1), 128), "W4-8": Workload("W4-8", prompts(8), 128)}
