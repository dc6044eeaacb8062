"""Errors the frontend raises about the engine process and what it runs."""


class EngineDeadError(RuntimeError):
    """The EngineCore process died; in-flight and new requests cannot complete."""

    def __init__(self, message: str = "The engine process died unexpectedly; restart the server.") -> None:
        super().__init__(message)

    def anew(self) -> "EngineDeadError":
        """This error as a new exception, raised in its place wherever a kept error is raised at every call (an
        engine known dead or shut down), as vLLM's raises a new one each time: an exception object raised again
        keeps each earlier raise's frames, and their locals, on its traceback, which grows with every call."""
        return EngineDeadError(*self.args)


def not_a_pooling_model(refusal: str) -> ValueError:
    """vLLM's ValueError for its pooling API on a generative model, ``refusal`` being its words; where vLLM's then
    suggests its pooling runner, this says that pagedllm has none (EngineArgs refuses runner="pooling")."""
    return ValueError(f"{refusal} pagedllm runs generative models only: it has no pooling runner (`--runner pooling`).")
