"""Errors the frontend raises about the engine process and what it runs."""


class EngineDeadError(RuntimeError):
    """The EngineCore process died; in-flight and new requests cannot complete."""

    def __init__(self, message: str = "The engine process died unexpectedly; restart the server.") -> None:
        super().__init__(message)


def not_a_pooling_model(refusal: str) -> ValueError:
    """vLLM's ValueError for its pooling API on a generative model, ``refusal`` being its words; where vLLM's then
    suggests its pooling runner, this says that pagedllm has none (EngineArgs refuses runner="pooling")."""
    return ValueError(f"{refusal} pagedllm runs generative models only: it has no pooling runner (`--runner pooling`).")
