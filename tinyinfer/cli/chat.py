"""`tinyinfer chat`: talk to a chat model in the terminal, its replies streamed as they come.

Each turn lays the whole conversation out with the model's own chat template and continues
it; one engine serves the whole chat, so the earlier turns' KV pages are found again by prefix
caching instead of being recomputed. /reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops
a reply early.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply."


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `chat` command on the top-level parser's subparsers."""
    from tinyinfer.cli.args import add_model_args, add_sampling_args

    parser = subparsers.add_parser(
        "chat", help="chat with a model in the terminal, using its chat template",
        description="An interactive chat: type a message, the model's reply streams back. "
                    + HELP)
    add_model_args(parser, default="smollm2")
    add_sampling_args(parser, max_tokens=512)
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="a system message that opens the conversation")
    return parser


def run(args: argparse.Namespace) -> int:
    """Load the model, then read messages from stdin until /exit or end of input."""
    import tinyinfer
    from tinyinfer.cli.args import load_model, sampling_params
    from tinyinfer.errors import TinyInferError

    model = load_model(args)
    template = model.chat_template
    if not template.trained:
        raise TinyInferError(f"{model.name} has no chat template (it was not trained on "
                             "conversations): chat with a chat model, e.g. --model smollm2, or "
                             "continue text with tinyinfer generate")
    if not model.has_tokenizer:
        raise TinyInferError(model.tokenizer_error)
    params = sampling_params(args, stop=template.stop)
    engine = tinyinfer.Engine(model)
    session = ChatSession(engine, params, args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    print(f"Chatting with {model.name} on the {model.runner.name} runner. {HELP}", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D quits)", file=sys.stderr)
            continue
        text = line.strip()
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            session.reset()
            print("(a new conversation)", file=sys.stderr)
        elif text.startswith("/"):
            print(f"unknown command {text.split()[0]}: {HELP}", file=sys.stderr)
        elif text:
            try:
                session.reply(text, sys.stdout)
            except TinyInferError as exc:  # e.g. the conversation outgrew the context
                print(f"tinyinfer: {exc}", file=sys.stderr)


class ChatSession:
    """A conversation: its messages, and one engine that continues them turn by turn."""

    def __init__(self, engine: Any, params: Any, system: str | None) -> None:
        self.engine, self.params = engine, params
        self.opening = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict[str, str]] = list(self.opening)

    def reset(self) -> None:
        self.messages = list(self.opening)

    def reply(self, text: str, out: TextIO) -> str:
        """Add the user's message, stream the model's reply to ``out`` and keep it.

        A message the model cannot take (the conversation no longer fits its context) is
        dropped again, so the conversation stays as it was."""
        model = self.engine.model
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = model.chat_template.render(messages)
        ids = model.chat_template.encode(model.tokenizer, prompt)
        request = self.engine.add_request(ids, self.params)
        chunks = []
        try:
            while True:
                done = self.engine.completion(request).finish_reason is not None
                if not done:
                    self.engine.step()
                chunks.append(self.engine.stream_text(request))  # the last: what was held back
                out.write(chunks[-1])
                out.flush()
                if done:
                    break
        except KeyboardInterrupt:  # stop this reply; what came so far stays in the conversation
            self.engine.abort_request(request)
        completion = self.engine.completion(request)
        self.engine.release(request)
        # "length" is --max-tokens here (a reply that would outgrow the context is refused at
        # add_request); say so: a reply cut mid-sentence looks like a bug
        if completion.finish_reason == "length":
            out.write(f" [cut: --max-tokens {self.params.max_tokens}]")
        out.write("\n")
        answer = "".join(chunks).strip()
        self.messages = [*messages, {"role": "assistant", "content": answer}]
        return answer
