"""Errors a user can cause. Each message says what went wrong and what to do."""


class TinyInferError(Exception):
    """Base class of every error tinyinfer raises on purpose."""


class ConfigError(TinyInferError):
    """A model config.json is missing, malformed or describes an unsupported model."""


class CheckpointError(TinyInferError):
    """Weights are missing, corrupt, mis-named or mis-shaped."""


class TokenizerError(TinyInferError):
    """A tokenizer file is missing or invalid, or text cannot be encoded."""


class SamplingParamsError(TinyInferError):
    """A sampling parameter is out of range or of the wrong type; ``field`` names it."""

    def __init__(self, message: str, field: str | None = None) -> None:  # one argument: it unpickles
        super().__init__(message)
        self.field = field


class PromptError(TinyInferError):
    """A prompt is empty or does not fit the model's context."""


class ContextOverflowError(PromptError):
    """Prompt plus requested output is longer than the model's context window."""


class InvalidLogitsError(TinyInferError, ValueError):
    """A row of logits holds NaN or +inf, or only -inf, so no token can be chosen: the checkpoint
    is corrupt, or a request's settings overflowed the math. The engine fails that request alone."""


class OutOfPagesError(TinyInferError):
    """The KV page pool cannot hold what was asked of it, even after evicting cached pages."""


# Optional packages, by the name Python imports, and the extra of pyproject.toml that brings each.
OPTIONAL_PACKAGES = {"torch": "torch", "uvicorn": "serve", "starlette": "serve",
                     "transformers": "test"}


class MissingPackageError(TinyInferError):
    """A feature needs an optional package that is not installed."""


def missing_package(exc: ModuleNotFoundError) -> MissingPackageError | None:
    """The clear error for an optional package that failed to import; None for any other module
    (a missing module of tinyinfer itself is a bug, not something a user installs)."""
    package = (exc.name or "").split(".")[0]
    extra = OPTIONAL_PACKAGES.get(package)
    if extra is None:
        return None
    return MissingPackageError(f"this needs {package}, which is not installed; install the "
                               f"'{extra}' extra: pip install -e '.[{extra}]'")
