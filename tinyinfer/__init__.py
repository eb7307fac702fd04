"""tinyinfer: an LLM inference engine you can step through, and that is also real.

    >>> import tinyinfer
    >>> model = tinyinfer.load("bundled")
    >>> engine = tinyinfer.Engine(model)
    >>> engine.generate("ROMEO:", tinyinfer.SamplingParams(max_tokens=20, temperature=0))
"""

from tinyinfer.config import ModelConfig
from tinyinfer.engine import Completion, Engine
from tinyinfer.engine_config import EngineConfig
from tinyinfer.errors import (
    CheckpointError,
    ConfigError,
    ContextOverflowError,
    OutOfPagesError,
    PromptError,
    SamplingParamsError,
    TinyInferError,
    TokenizerError,
)
from tinyinfer.model import Model, load
from tinyinfer.sampling import SamplingParams
from tinyinfer.trace import StepTrace

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "Completion", "ConfigError", "ContextOverflowError", "Engine", "EngineConfig",
    "Model",
    "ModelConfig", "OutOfPagesError", "PromptError", "SamplingParams", "SamplingParamsError",
    "StepTrace", "TinyInferError", "TokenizerError", "load",
]
