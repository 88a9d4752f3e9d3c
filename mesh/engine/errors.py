"""Errors a user can act on; their messages are shown as they are (one line)."""


class ModelError(ValueError):
    """A model directory that cannot be served."""


class RequestError(ValueError):
    """A request the engine cannot serve (too long, bad token ids)."""
