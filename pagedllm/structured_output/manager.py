"""StructuredOutputManager (engine core side): compiles grammars off the busy loop and builds each step's
token bitmask.

Compiling a JSON schema against a 49k-token vocabulary takes milliseconds to seconds; it runs in a worker
thread while the scheduler keeps serving other requests (the request waits in WAITING_FOR_FSM). Compiled
grammars are cached by spec, and concurrent requests with the same spec share one compile.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Callable, Optional

import msgspec
import torch

from pagedllm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from pagedllm.structured_output.backend_xgrammar import XgrammarBackend
    from pagedllm.core.request import Request

_CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, max_num_seqs: int,
                 disable_any_whitespace: bool = True) -> None:
        self._load_tokenizer = load_tokenizer
        # What a request that does not set disable_any_whitespace gets (StructuredOutputsConfig's).
        self._disable_any_whitespace = disable_any_whitespace
        self._vocab_size = vocab_size
        self._max_num_seqs = max_num_seqs
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._backend: Optional[XgrammarBackend] = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._bitmask: Optional[torch.Tensor] = None

    def _get_backend(self) -> XgrammarBackend:
        """Built on first use, in the compile thread: loading the tokenizer's vocabulary is too slow for the
        engine's busy loop."""
        with self._backend_lock:
            if self._backend is None:
                from pagedllm.structured_output.backend_xgrammar import XgrammarBackend  # xgrammar: on first use
                self._backend = XgrammarBackend(self._load_tokenizer(), self._vocab_size)
            return self._backend

    def grammar_init(self, request: "Request") -> None:
        params = request.sampling_params.structured_outputs
        if params.disable_any_whitespace is None:
            params = msgspec.structs.replace(params, disable_any_whitespace=self._disable_any_whitespace)
        key = params.key
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._executor.submit(lambda: self._get_backend().compile(params))
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        stop_token_ids = request.sampling_params.all_stop_token_ids(request.eos_token_id)
        request.structured_output_request = StructuredOutputRequest(future, stop_token_ids,
                                                                    params._reasoning_end_token_ids)

    def wait_for_any(self, requests: list["Request"], timeout: float) -> None:
        """Sleeps until one of the requests' grammars is compiled (or the timeout): the busy loop has nothing
        else to do, and spinning would steal the CPU the compile needs."""
        pending = [r.structured_output_request.future for r in requests
                   if r.structured_output_request is not None and not r.structured_output_request.future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def grammar_bitmask(self, requests: list["Request"]) -> torch.Tensor:
        """Row i: the tokens requests[i] may sample next (one bit per token)."""
        if self._bitmask is None or self._bitmask.shape[0] < len(requests):
            self._bitmask = self._get_backend().allocate_bitmask(max(self._max_num_seqs, len(requests)))
        bitmask = self._bitmask
        for row, request in enumerate(requests):
            request.structured_output_request.grammar.fill_bitmask(bitmask, row)
        return bitmask[:len(requests)].clone()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
