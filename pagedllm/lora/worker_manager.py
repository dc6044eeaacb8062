"""The worker's adapters (vLLM's LRUCacheWorkerLoRAManager): ``max_loras`` slots on the model's LoRA'd layers (the
decoder layers' projections, and on the stages that have them the token embedding and the LM head's logits), and up to
``max_cpu_loras`` adapters kept loaded (least recently used dropped first), so that an adapter coming back costs a copy
into a slot, not a read of its files. Pinned adapters (vLLM's pin_lora) are never dropped from the kept ones, and their
slots are reused only when a step needs more slots than the others free."""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Optional

import torch
from torch import nn

from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.lora.layers import EmbeddingLoRA, LinearLoRA, LogitsLoRA
from pagedllm.lora.lora_model import EMBEDDING_MODULES, NUM_SLICES, LoRAModel
from pagedllm.lora.punica import PunicaWrapper
from pagedllm.lora.request import LoRARequest

_LORA_LAYER = re.compile(r"^model\.layers\.\d+\.(" + "|".join(re.escape(n) for n in NUM_SLICES) + r")$")


class WorkerLoRAManager:
    def __init__(self, model: nn.Module, hf_config, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype = torch.float32):
        self.hf_config = hf_config
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.punica = PunicaWrapper()
        self.logits_punica = PunicaWrapper()  # each logits row's slot, for the LM head's LoRA
        self.token_slots = torch.empty(0, dtype=torch.int64)  # the step's tokens' slots (-1: none)
        # the model's LoRA'd layers by LoRAModel.layers' names (a tied LM head's LoRA is the logits', not the lookup's)
        self.layers: dict[str, LinearLoRA | EmbeddingLoRA] = {}
        self.embedding: EmbeddingLoRA | None = None
        self.logits: LogitsLoRA | None = None
        for name, module in model.named_modules():
            if _LORA_LAYER.match(name):
                module.lora = LinearLoRA(module, max_loras, max_lora_rank, self.punica, dtype)
                self.layers[name] = module.lora
            elif name == EMBEDDING_MODULES["embed_tokens"] and isinstance(module, VocabParallelEmbedding):
                module.lora = self.embedding = EmbeddingLoRA(module, max_loras, max_lora_rank, self.punica, dtype)
                self.layers[name] = module.lora
            elif name == "logits_processor" and isinstance(module, LogitsProcessor):
                module.lora = self.logits = LogitsLoRA(hf_config.hidden_size, module.vocab_size, max_loras,
                                                       max_lora_rank, self.logits_punica, dtype)
                self.layers[EMBEDDING_MODULES["lm_head"]] = module.lora
        self.slot_ids: list[int | None] = [None] * max_loras  # the adapter id in each slot
        self._slot_use = [0] * max_loras  # the step a slot last served, for choosing which to reuse
        self._step = 0
        self.loaded: OrderedDict[int, LoRAModel] = OrderedDict()  # id -> adapter, least recently used first
        self.pinned: set[int] = set()  # ids in ``loaded`` that are never dropped from it (at most max_cpu_loras)

    def _get(self, request: LoRARequest, reload: bool = False) -> LoRAModel:
        model = None if reload else self.loaded.get(request.lora_int_id)
        if model is None:
            model = LoRAModel.from_local_checkpoint(request.lora_path, request.lora_int_id, self.hf_config,
                                                    self.max_lora_rank)
            self.loaded[request.lora_int_id] = model
            # The least recently used unpinned ones go; with every other one pinned, the new one stays (one over).
            unpinned = [i for i in self.loaded if i not in self.pinned and i != request.lora_int_id]
            for lora_id in unpinned[:max(len(self.loaded) - self.max_cpu_loras, 0)]:
                del self.loaded[lora_id]
        self.loaded.move_to_end(request.lora_int_id)
        return model

    def add(self, request: LoRARequest) -> None:
        """Loads an adapter into the kept ones ahead of its first step (vLLM's add_lora), so that reading its files
        fails its request, not a step (and so the engine); raises what loading raises. ``load_inplace`` reads them
        again even when the id is loaded, and empties the id's slot, so that the next step copies the new weights in
        (vLLM's in-place reload); a reload that fails leaves the adapter as it was."""
        self._get(request, reload=request.load_inplace)
        if request.load_inplace and request.lora_int_id in self.slot_ids:
            self.slot_ids[self.slot_ids.index(request.lora_int_id)] = None

    def remove(self, lora_id: int) -> bool:
        """vLLM's remove_adapter: the adapter is dropped (unpinned) from the kept ones and its slot; whether it was
        kept. A request running with it reads its files again at its next step, as vLLM's."""
        if lora_id in self.slot_ids:
            self.slot_ids[self.slot_ids.index(lora_id)] = None
        self.pinned.discard(lora_id)
        return self.loaded.pop(lora_id, None) is not None

    def pin(self, lora_id: int) -> Optional[str]:
        """vLLM's pin_adapter: a kept adapter is never dropped from the kept ones; why it cannot be, else None. At most
        max_cpu_loras are pinned, so that the kept ones stay bounded (vLLM's add fails when all are pinned)."""
        if lora_id not in self.loaded:
            return f"Pinning failed. LoRA {lora_id} is not registered."
        if lora_id not in self.pinned and len(self.pinned) >= self.max_cpu_loras:
            return f"Pinning failed: max_cpu_loras={self.max_cpu_loras} adapters are pinned already."
        self.pinned.add(lora_id)
        return None

    def set_active_loras(self, requests: dict[int, LoRARequest], token_lora_ids: torch.Tensor) -> None:
        """Put this step's adapters (at most max_loras: the scheduler's promise) into slots and map each token
        (``token_lora_ids[i]``: its request's adapter id, 0 for none) to its adapter's slot."""
        self._step += 1
        if len(requests) > self.max_loras:
            raise RuntimeError(f"{len(requests)} adapters in one step; max_loras is {self.max_loras}")
        slot_of = {held: slot for slot, held in enumerate(self.slot_ids) if held in requests}
        reusable = sorted((s for s in range(self.max_loras) if self.slot_ids[s] not in requests),
                          key=lambda s: (self.slot_ids[s] is not None, self.slot_ids[s] in self.pinned,
                                         self._slot_use[s]))
        for lora_id, request in requests.items():
            if lora_id not in slot_of:
                slot = reusable.pop(0)
                model = self._get(request)
                for name, layer in self.layers.items():
                    layer.set_slot(slot, model.layers.get(name))
                self.slot_ids[slot], slot_of[lora_id] = lora_id, slot
            elif lora_id in self.loaded:
                # The most recently used. Dropped from the kept ones meanwhile (another adapter's request came), it
                # is not read again: its slot holds its weights, and a step must not read files, which may be gone.
                self.loaded.move_to_end(lora_id)
            self._slot_use[slot_of[lora_id]] = self._step
        self.punica.needs_eager = self.embedding is not None and any(self.embedding.holds[s] for s in slot_of.values())
        if not requests:
            self.token_slots = torch.empty(0, dtype=torch.int64)
            self.punica.clear()
            return
        # Each token's slot: its adapter id looked up among this step's (sorted), -1 for none (id 0) — ids are any
        # positive integers, so no table indexed by them.
        ids = torch.tensor(sorted(slot_of), dtype=token_lora_ids.dtype)
        slots = torch.tensor([slot_of[lora_id] for lora_id in sorted(slot_of)], dtype=torch.long)
        at = torch.searchsorted(ids, token_lora_ids).clamp_(max=len(ids) - 1)
        self.token_slots = torch.where(ids[at] == token_lora_ids, slots[at], -1)
        self.punica.update(self.token_slots)

    def set_logits_rows(self, token_indices: torch.Tensor) -> None:
        """Map each row of the next logits (the hidden states of the step's tokens ``token_indices``) to its token's
        slot, for the LM head's LoRA."""
        if self.logits is not None:
            self.logits_punica.update(self.token_slots[token_indices] if self.token_slots.numel()
                                      else torch.empty(0, dtype=torch.int64))
