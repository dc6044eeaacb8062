"""Errors the frontend raises about the engine process."""


class EngineDeadError(RuntimeError):
    """The EngineCore process died; in-flight and new requests cannot complete."""

    def __init__(self, message: str = "The engine process died unexpectedly; restart the server.") -> None:
        super().__init__(message)
