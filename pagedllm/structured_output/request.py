"""StructuredOutputRequest: a request's grammar, compiling in the background until the scheduler finds it ready."""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pagedllm.structured_output.backend_xgrammar import XgrammarGrammar


class StructuredOutputRequest:
    def __init__(self, compiled_future: Future, stop_token_ids: set[int],
                 reasoning_end_token_ids: Optional[list[int]] = None) -> None:
        self.future = compiled_future
        self.grammar: Optional[XgrammarGrammar] = None
        # The tokens the finished grammar may end on: all the request's stop tokens, as vLLM's grammars.
        self.stop_token_ids = stop_token_ids
        # While the request reasons, its grammar neither masks its tokens nor reads them.
        self.reasoning_end_token_ids = reasoning_end_token_ids or []
        self.reasoning_ended = not self.reasoning_end_token_ids

    def observe_reasoning_token(self, token_id: int) -> None:
        """A token sampled while the request reasons: after one that ends the reasoning, the grammar applies."""
        if token_id in self.reasoning_end_token_ids:
            self.reasoning_ended = True

    def is_ready(self) -> bool:
        """True once compiled (the matcher then exists); raises the compile error if compiling failed."""
        if self.grammar is not None:
            return True
        if not self.future.done():
            return False
        from pagedllm.structured_output.backend_xgrammar import XgrammarGrammar  # loaded by the compile
        self.grammar = XgrammarGrammar(self.future.result(), self.stop_token_ids)
        return True

    @property
    def constrains_next_token(self) -> bool:
        """The grammar masks the next token once the reasoning has ended, until it has ended itself: what follows
        its end (under ignore_eos, where its EOS ends no request) is free, as vLLM's full mask after termination."""
        return self.reasoning_ended and not self.grammar.is_terminated()
