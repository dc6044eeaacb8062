"""Beam search in the frontend, on top of the engine, as vLLM runs it, with Hugging Face's selection rules.

Each step submits every live beam as a one-token request asking for the top 2 * beam_width (raw) logprobs;
the prefix cache makes re-submitting a beam cost about one token. BeamSearchInstance.step turns one step's
outputs into the next beams; LLM.beam_search and AsyncLLM.beam_search are its two drivers.

The selection follows transformers' GenerationMixin._beam_search (the project's oracle), which differs from
vLLM's: a finished hypothesis's score is cum_logprob / generated_len ** length_penalty, where generated_len
counts the generated tokens including the EOS and not the prompt (vLLM counts the prompt and not the EOS);
an EOS candidate finishes only if it ranks within the step's top beam_width candidates (vLLM keeps every
one); at most beam_width finished hypotheses are kept; and the search stops early once beam_width have
finished and the best live beam, scored at its current length, is no better than the worst of them (vLLM
always runs max_tokens steps). At max_tokens the step's top beam_width candidates finish with "length".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One beam: tokens are the prompt's then the generated ones (ending with the EOS if it finished on one);
    logprobs, one per generated token, are its step's candidates (the top 2 * beam_width, as vLLM keeps them)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None


@dataclass
class BeamSearchOutput:
    """The beam_width best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """One prompt's search: the live beams, and the best finished hypotheses with their scores."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: Optional[int],
                 cache_salt: Optional[str] = None) -> None:
        """``cache_salt``: the prompt's, which every beam's step prompt carries (as vLLM's beams keep it)."""
        self.params = params
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(self.prompt_token_ids)]
        # (score, sequence), best first, at most beam_width.
        self.completed: list[tuple[float, BeamSearchSequence]] = []
        self.finished = False

    def step_prompt(self, beam: BeamSearchSequence) -> dict:
        """The prompt that asks for ``beam``'s next token."""
        return {"prompt_token_ids": beam.tokens, "cache_salt": self.cache_salt}

    def step(self, outputs: list[RequestOutput]) -> None:
        """Expands the live beams with their step outputs (outputs[i] is beams[i]'s) and keeps the best."""
        width, length_penalty = self.params.beam_width, self.params.length_penalty
        num_generated = len(self.beams[0].tokens) - self.prompt_len + 1
        at_limit = num_generated == self.params.max_tokens
        candidates = sorted(((beam.cum_logprob + lp.logprob, beam, token, step)
                             for beam, step in zip(self.beams, map(_step_logprobs, outputs))
                             for token, lp in step.items()),
                            key=lambda c: -c[0])[:2 * width]
        live = []
        for rank, (cum_logprob, beam, token, step) in enumerate(candidates):
            seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step], cum_logprob)
            if token == self.eos_token_id and not self.params.ignore_eos:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif at_limit:
                seq.finish_reason = "length"
            else:
                live.append(seq)
                continue
            if rank < width:  # the candidates past the top beam_width only stand by to keep the beams full
                self.completed.append((_score(cum_logprob, num_generated, length_penalty), seq))
        self._keep_best()
        self.beams = live[:width]
        # HF's early stop (early_stopping=False): the best live beam, scored at its current length, cannot
        # beat the worst of beam_width finished hypotheses.
        self.finished = at_limit or not self.beams or (
            len(self.completed) == width
            and _score(self.beams[0].cum_logprob, num_generated, length_penalty) <= self.completed[-1][0])

    def abort(self) -> None:
        """Ends the search where it stands, as vLLM's does when a step's request is aborted: the live beams finish
        with "abort" and join the finished hypotheses, the best beam_width of all kept."""
        for beam in self.beams:
            beam.finish_reason = "abort"
            num_generated = len(beam.tokens) - self.prompt_len
            self.completed.append((_score(beam.cum_logprob, num_generated, self.params.length_penalty), beam))
        self._keep_best()
        self.beams, self.finished = [], True

    def _keep_best(self) -> None:
        self.completed.sort(key=lambda c: -c[0])  # stable: on a tie the earlier hypothesis stays ahead
        del self.completed[self.params.beam_width:]

    def output(self, tokenizer: Any) -> BeamSearchOutput:
        """The finished hypotheses, best first, with their generated text."""
        sequences = [seq for _, seq in self.completed]
        for seq in sequences:
            generated = seq.tokens[self.prompt_len:]
            if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]
            seq.text = tokenizer.decode(generated, skip_special_tokens=self.params.skip_special_tokens)
        return BeamSearchOutput(sequences)

    def request_output(self, request_id: str, prompt: Optional[str], tokenizer: Any) -> RequestOutput:
        """The result as one finished RequestOutput whose outputs are the beams, best first (as vLLM serves it)."""
        sequences = self.output(tokenizer).sequences
        return RequestOutput(
            request_id, prompt, self.prompt_token_ids, None,
            [CompletionOutput(i, seq.text, seq.tokens[self.prompt_len:], seq.cum_logprob, seq.logprobs,
                              seq.finish_reason, seq.stop_reason) for i, seq in enumerate(sequences)],
            finished=True)


def _score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """HF's score, cum_logprob / num_generated ** length_penalty. Where an extreme length_penalty takes the power
    out of float's range, the score is its limit (0 for an infinite power, -inf for a vanishing one) instead of an
    OverflowError or ZeroDivisionError."""
    try:
        power = float(num_generated) ** length_penalty
    except OverflowError:
        return 0.0
    return cum_logprob / power if power else -math.inf


def _step_logprobs(output: RequestOutput) -> dict[int, Logprob]:
    """One beam's candidates: its step's top logprobs (the engine's refusal becomes a ValueError)."""
    if output.error is not None:
        raise ValueError(output.error)
    return output.outputs[0].logprobs[0]
