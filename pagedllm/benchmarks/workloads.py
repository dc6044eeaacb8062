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
