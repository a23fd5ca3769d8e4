"""User-facing errors.

Every error a user can cause (a bad path, a corrupt file, an unknown architecture, a bad
option) is a `LocalMoEError`: the CLI prints its message without a traceback. Messages
name the file, tensor or field at fault and say what to do.
"""


class LocalMoEError(Exception):
    """An error with a message meant for the user; shown without a traceback."""


class CheckpointError(LocalMoEError):
    """A weight file is missing, truncated, corrupt or not in the expected layout."""


class UnsupportedModelError(LocalMoEError):
    """The checkpoint's architecture (model_type / general.architecture) is not supported."""


class TokenizerError(LocalMoEError):
    """The tokenizer or chat template cannot be built or rendered."""


class RequestError(LocalMoEError):
    """A request the runtime refuses (a bad field, a prompt that does not fit): `param` names the field
    at fault, `code` a machine-readable reason. The server answers it with a 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class NotFoundError(RequestError):
    """The request names something not served here (a model, a session); the server answers 404."""


class CancelledError(LocalMoEError):
    """A generation was cancelled before it finished (its client went away)."""
