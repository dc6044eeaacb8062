"""OpenAIServingModels: the names the model is served under, /v1/models, and the 404 for any other name."""
from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.errors import NotFoundError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int) -> None:
        self.served_model_names = served_model_names
        self.model_path = model_path
        self.max_model_len = max_model_len

    @property
    def model_name(self) -> str:
        """The name responses carry when a request names none."""
        return self.served_model_names[0]

    def check_model(self, model: Optional[str]) -> str:
        """The name to answer with; a request may leave the model out, as with vLLM."""
        if not model:
            return self.model_name
        if model not in self.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")
        return model

    def show_available_models(self) -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len,
                      permission=[ModelPermission()])
            for name in self.served_model_names])
