"""The Sampler: turns one step's logits into next tokens (greedy and random rows mixed) and their logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.native import fused
from pagedllm.sample.logprobs import PROCESSED_LOGPROBS_MODES, LogprobsMode, LogprobsTensors, compute_token_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops import (apply_allowed_token_ids, apply_bad_words, apply_forced_tokens, apply_logit_bias,
                                 apply_min_p, apply_min_tokens, apply_top_k_top_p)
from pagedllm.sample.penalties import apply_penalties

_SAMPLING_EPS = 1e-5


@dataclass
class SamplerOutput:
    # [B] int64
    sampled_token_ids: torch.Tensor
    # Present when some row asked for logprobs; each row later keeps its own first k alternatives.
    logprobs: LogprobsTensors | None


class Sampler(nn.Module):
    """Samples as vLLM V1 does: allowed_token_ids, bad_words, min_tokens, logit_bias, penalties and a spent
    thinking_token_budget's forced token, then greedy argmax or temperature -> min-p -> top-k -> top-p.

    Logprobs follow ``logprobs_mode`` (vLLM's, sample/logprobs.LogprobsMode): by default they are of the raw
    logits, whatever the sampling knobs; the processed modes report the logits each row sampled from (final_logits;
    the processed logits alone for an all-greedy batch, as vLLM). The input logits are not modified.
    """

    def __init__(self, logprobs_mode: LogprobsMode = "raw_logprobs") -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        processed = self.process_logits(logits, metadata)
        final = processed if metadata.all_greedy else self.final_logits(processed, metadata)
        sampled = self.sample(processed, final, metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            scored = final if self.logprobs_mode in PROCESSED_LOGPROBS_MODES else logits
            logprobs = compute_token_logprobs(scored, sampled, metadata.max_num_logprobs, self.logprobs_mode,
                                              metadata.logprob_token_ids)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def process_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The per-request controls, on one copy of the logits (none when no row uses any); rows without
        controls keep their logits bit for bit."""
        if not (metadata.allowed_token_ids or metadata.bad_words_token_ids or metadata.min_tokens_mask
                or metadata.logit_bias or metadata.penalties is not None or metadata.forced_token_ids):
            return logits
        logits = logits.clone()
        apply_allowed_token_ids(logits, metadata.allowed_token_ids)
        apply_bad_words(logits, metadata.bad_words_token_ids, metadata.output_token_ids)
        apply_min_tokens(logits, metadata.min_tokens_mask, metadata.min_tokens_restorable)
        apply_logit_bias(logits, metadata.logit_bias)
        if metadata.penalties is not None:
            apply_penalties(logits, metadata.penalties)
        apply_forced_tokens(logits, metadata.forced_token_ids)  # last, over every other control, as vLLM's
        return logits

    @staticmethod
    def sample(processed: torch.Tensor, final: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax of the processed logits, random rows sample softmax(final logits)."""
        greedy_sampled = None if metadata.all_random else greedy_sample(processed)
        if metadata.all_greedy:
            return greedy_sampled
        random_sampled = random_sample(final.softmax(dim=-1), metadata.generators)
        if greedy_sampled is None:
            return random_sampled
        return torch.where(is_greedy(metadata, len(processed)), greedy_sampled, random_sampled)

    @staticmethod
    def final_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The logits each random row samples from (processed logits -> temperature -> min-p -> top-k -> top-p,
        vLLM V1's order: min-p, as a logits processor, before the top-k/top-p sampler); greedy rows get
        temperature 1 and no mask, so theirs are the processed logits. A new tensor."""
        assert metadata.temperature is not None, "a batch with random rows needs temperatures"
        temperature = metadata.temperature
        if not metadata.all_random:
            # Greedy rows take the argmax; divide them by 1 to avoid dividing by zero.
            temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
        logits = logits / temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        return apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)


def is_greedy(metadata: SamplingMetadata, num_rows: int) -> torch.Tensor:
    """[num_rows] bool: the rows that take the argmax (temperature 0)."""
    if metadata.temperature is None:  # an all-greedy batch
        return torch.ones(num_rows, dtype=torch.bool)
    return metadata.temperature < _SAMPLING_EPS


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: native where it applies (a float32 decode batch on CPU), torch's otherwise."""
    sampled = fused.argmax_rows(logits)
    return logits.argmax(dim=-1) if sampled is None else sampled


_MASK64 = (1 << 64) - 1


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator a seeded request's token at output ``position`` draws its noise from: its own for each
    position (splitmix64 of the seed and the position), so that what a token draws does not depend on how many
    draws came before it: the same seed gives the same tokens whatever else is in the batch, after a preemption,
    and with speculative decoding whatever drafts were verified (RejectionSampler)."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.Generator().manual_seed(z ^ (z >> 31))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row as argmax(probs / q), q ~ Exponential(1): the exponential race.

    Equivalent to multinomial sampling, but each row's noise is a plain tensor, so seeded rows can draw
    theirs from their own generator and get the same tokens whatever else is in the batch.
    Modifies probs in place. The exponentials are drawn as -log(U), U ~ Uniform[0, 1): on CPU uniform_ + log
    takes a fraction of the time torch's exponential_ does.
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.uniform_()
    for row, generator in generators.items():
        q[row].uniform_(generator=generator)
    return probs.div_(q.log_().neg_()).argmax(dim=-1)
