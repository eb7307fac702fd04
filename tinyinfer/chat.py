"""Chat messages → one prompt: the checkpoint's Jinja2 chat template, or a simple documented one.

A chat model was trained on conversations laid out in one exact format (role markers, special
tokens); the template in its `tokenizer_config.json` (or `chat_template.jinja`, or a GGUF
file's ``tokenizer.chat_template``) reproduces it.
Models without one — like the bundled Shakespeare model — get the simple template:

    system: You are a poet.
    user: Write about the sea.
    assistant:

and generation stops where the model starts the user's next line ("\\nuser:").
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tinyinfer.errors import TinyInferError
from tinyinfer.tokenizer import Tokenizer
from tinyinfer.weights.gguf_file import GGUFCheckpoint


class ChatTemplateError(TinyInferError):
    """A checkpoint's chat template cannot be read, or refuses a conversation."""


class ChatTemplate(Protocol):
    """Lays out a conversation as the text the model continues."""

    name: str
    stop: tuple[str, ...]  # stop strings the layout implies, added to the request's own
    trained: bool  # whether the model was trained on this layout (its own template)

    def render(self, messages: Sequence[dict[str, str]]) -> str: ...

    def encode(self, tokenizer: Tokenizer, text: str) -> list[int]: ...


class SimpleChatTemplate:
    """'role: content' lines, then 'assistant:' — for models trained on plain text."""

    name = "simple"
    stop = ("\nuser:",)
    trained = False

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """One line per message, then the cue for the model's turn."""
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def encode(self, tokenizer: Tokenizer, text: str) -> list[int]:
        """Plain text: a special-token string typed by a user stays plain text."""
        return tokenizer.encode(text)


class JinjaChatTemplate:
    """A Hugging Face chat template rendered in Jinja2's sandbox, as transformers does."""

    stop: tuple[str, ...] = ()
    trained = True

    def __init__(self, source: str, variables: dict[str, Any], name: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template of {name} does not parse: {exc}; "
                                    "fix or remove chat_template") from None
        self._variables = variables
        self.name = name

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The conversation in the model's own format, ending with the assistant's cue."""
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True,
                                         **self._variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None

    def encode(self, tokenizer: Tokenizer, text: str) -> list[int]:
        """Template text: its role markers are special tokens, so encode them as such."""
        return tokenizer.encode(text, allow_special=True)


def _raise_exception(message: str) -> None:
    """Templates call raise_exception('...') to refuse a conversation (e.g. roles out of order)."""
    raise jinja2.TemplateError(message)


def _token_text(value: Any) -> str:
    """A special token in tokenizer_config.json: a string or {"content": string}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_source(folder: Path) -> tuple[str | None, dict[str, Any]]:
    """The template text (chat_template.jinja, else tokenizer_config.json) and the config."""
    config_path = folder / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"cannot read {config_path}: {exc}") from None
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8"), config
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # older layout: named templates; the default one is ours
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is not None and not isinstance(source, str):
        raise ChatTemplateError(f"{config_path}: chat_template must be a string")
    return source, config


def load_chat_template(path: Path, gguf: GGUFCheckpoint | None = None) -> ChatTemplate:
    """The model's own chat template if it has one (a folder's files, or ``gguf``'s metadata
    for the GGUF file at ``path``), else the simple template."""
    if gguf is not None:
        source, variables = gguf.value("tokenizer.chat_template", None), gguf.special_token_texts()
    else:
        source, config = _read_source(Path(path))
        variables = {key: _token_text(config.get(key))
                     for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    if source is None:
        return SimpleChatTemplate()
    return JinjaChatTemplate(source, variables, name=f"{Path(path).name}/chat_template")
