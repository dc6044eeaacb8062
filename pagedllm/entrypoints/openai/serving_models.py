"""OpenAIServingModels: the names the model is served under, the LoRA adapters served beside it (each its own
"model" in /v1/models, with the base model, or the served name --lora-modules gives it, as its parent), and the 404
for any other name."""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Optional

import msgspec

from pagedllm.entrypoints.openai.errors import BadRequestError, InvalidUserInputError, NotFoundError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission
from pagedllm.lora.peft_helper import LoRAAdapterNotFoundError
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int,
                 engine_client: Any = None, default_sampling_params: Optional[dict] = None) -> None:
        """``engine_client``: its processor checks an adapter against the model before it is served, and the
        run-time routes load it into the engine (add_lora) and drop it from there (remove_lora).
        ``default_sampling_params``: the model's generation config's, shown on every card (adapters too: their
        requests get the same)."""
        self.served_model_names = served_model_names
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.default_sampling_params = default_sampling_params or {}
        self.engine_client = engine_client
        self.processor = getattr(engine_client, "processor", None)
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)  # never reused: an id names one adapter for the engine's lifetime
        self._load_lock = asyncio.Lock()

    @property
    def model_name(self) -> str:
        """The name responses carry when a request names none."""
        return self.served_model_names[0]

    def check_model(self, model: Optional[str]) -> str:
        """The name to answer with: an adapter's own, else the first served name whichever alias the request named
        (vLLM's model_name()); a request may leave the model out, as with vLLM."""
        if model and model not in self.served_model_names and model not in self.lora_requests:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")
        return model if model in self.lora_requests else self.model_name

    def lora_request(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's "model" names; None for the base model."""
        return self.lora_requests.get(model) if model else None

    def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: Optional[str] = None,
                          load_inplace: bool = False) -> LoRARequest:
        """Serve an adapter under ``lora_name``; 400 when the name or the path is empty, the name a served model's,
        or an adapter's unless ``load_inplace`` (vLLM's: the new adapter replaces that one), each of type
        "InvalidUserInput" as vLLM's, or when the adapter does not fit the model; 404
        when the path holds no adapter (no adapter_config.json: vLLM's LoRAAdapterNotFoundError). Nothing changes
        on an error. A reloaded adapter keeps its id, as vLLM's: the engine reloads that id's weights, which the
        requests already running with it take at their next step; the prefix cache keys blocks by name and path
        (vLLM's), so one reloaded from the same path shares the old one's blocks, with a warning, as vLLM's.
        ``base_model_name`` (--lora-modules' JSON form): the served name /v1/models gives as its parent; one that is
        not served is ignored, as by vLLM (the parent is then the first name).
        Reads the adapter's files: the server's route calls load_lora_adapter_async, which does that off its loop."""
        return self._serve(self._check_lora_adapter(lora_name, lora_path, base_model_name, load_inplace))

    async def load_lora_adapter_async(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> LoRARequest:
        """load_lora_adapter for the server: the adapter's files are read and checked on a thread, so that a large
        one does not stall every stream meanwhile, one load at a time (as vLLM's lock), so that two loads of one
        name cannot both pass the check that it is free. Then the engine loads it (vLLM's add_lora at load time):
        an adapter whose weights cannot be loaded is this request's 400, not its first user's failure, and nothing
        is served. Served from the loop, the one place that changes lora_requests (a route iterating it meanwhile
        would see it change size). An adapter loaded in place is reloaded under its id (load_inplace); one that
        fails to load leaves the one it would have replaced served, as it was."""
        async with self._load_lock:
            lora = await asyncio.to_thread(self._check_lora_adapter, lora_name, lora_path, None, load_inplace)
            try:
                await self.engine_client.add_lora(lora)
            except Exception as e:
                self.processor.forget_lora(lora.lora_int_id)
                raise BadRequestError(f"Loading lora {lora_name} failed: {e}", "lora_path") from e
            return self._serve(lora)

    async def init_static_loras(self) -> None:
        """vLLM's: the engine loads the adapters served from the start (--lora-modules) before the first request, so
        that one whose weights cannot be loaded stops the start, a ValueError naming it."""
        for lora in self.lora_requests.values():
            try:
                await self.engine_client.add_lora(lora)
            except Exception as e:
                raise ValueError(f"--lora-modules {lora.lora_name}: {e}") from None

    def _check_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: Optional[str],
                            load_inplace: bool) -> LoRARequest:
        if not lora_name or not lora_path:
            raise InvalidUserInputError("Both 'lora_name' and 'lora_path' must be provided.")
        if lora_name in self.served_model_names:
            raise InvalidUserInputError(f"The lora adapter '{lora_name}' conflicts with a served base model.")
        if lora_name in self.lora_requests and not load_inplace:
            raise InvalidUserInputError(f"The lora adapter '{lora_name}' has already been loaded. If you want to load "
                                        "the adapter in place, set 'load_inplace' to True.")
        if self.processor is None or self.processor.lora_config is None:
            raise BadRequestError("LoRA is not enabled on this server (start it with --enable-lora).", "lora_name")
        previous = self.lora_requests.get(lora_name)
        try:
            # Loaded in place (vLLM's), it takes the id of the adapter it replaces, and the engine reads that id's
            # weights again (load_inplace), where a new id would leave the requests running with the old one on it.
            lora = LoRARequest(lora_name, next(self._lora_ids) if previous is None else previous.lora_int_id,
                               lora_path, base_model_name if base_model_name in self.served_model_names else None,
                               load_inplace=previous is not None)
            self.processor.validate_lora_request(lora)
        except LoRAAdapterNotFoundError:
            raise NotFoundError(f"Loading lora {lora_name} failed: No adapter found for {lora_path}") from None
        except ValueError as e:
            raise BadRequestError(str(e), "lora_path") from e
        return lora

    def _serve(self, lora: LoRARequest) -> LoRARequest:
        """Its requests name it without load_inplace: the engine reloads it once, not at each request."""
        lora = msgspec.structs.replace(lora, load_inplace=False)
        lora_name, lora_path = lora.lora_name, lora.lora_path
        previous = self.lora_requests.get(lora_name)
        if previous is not None and previous.lora_path == lora_path:
            logger.warning("Reloaded LoRA adapter '%s' in place from the same path '%s'. Prefix-cache blocks computed "
                           "with its previous weights are not invalidated; load changed weights from a new path to "
                           "avoid reusing them.", lora_name, lora_path)
        self.lora_requests[lora_name] = lora
        return lora

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """The adapter is no longer served, and the engine drops its weights (requests running with it read them
        again at their next step). Errors as vLLM's: no name is a 400, an unknown one a 404."""
        if not lora_name:
            raise InvalidUserInputError("'lora_name' needs to be provided to unload a LoRA adapter.")
        lora = self.lora_requests.pop(lora_name, None)
        if lora is None:
            raise NotFoundError(f"The lora adapter '{lora_name}' cannot be found.")
        await self.engine_client.remove_lora(lora.lora_int_id)

    def show_available_models(self) -> ModelList:
        def card(name: str, root: str, parent: Optional[str] = None) -> ModelCard:
            return ModelCard(id=name, root=root, parent=parent, max_model_len=self.max_model_len,
                             default_sampling_params=self.default_sampling_params, permission=[ModelPermission()])

        return ModelList(data=[card(name, self.model_path) for name in self.served_model_names]
                         + [card(name, lora.lora_path, lora.base_model_name or self.model_name)
                            for name, lora in self.lora_requests.items()])
