"""Errors a user can act on; their messages are shown as they are (one line)."""


class ModelError(ValueError):
    """A model directory that cannot be served."""


class RequestError(ValueError):
    """A request the engine cannot serve (too long, bad token ids)."""


class LoraError(ModelError):
    """A LoRA adapter directory that cannot be served (names the file at fault)."""


class UnknownAdapterError(RequestError):
    """A request names a LoRA adapter this engine has not loaded (an API answers 404)."""
