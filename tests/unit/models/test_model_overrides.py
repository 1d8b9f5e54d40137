"""What a user changes about a model at start-up: the names models are served under
(--served-model-name), their tokenizer (--tokenizer) and chat template
(--chat-template, a file or the template itself)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from carpool.config import ConfigError, ServerConfig
from carpool.models.causal_lm import customize_tokenizer
from carpool.server.bootstrap import served_sources

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_models_are_served_under_the_names_given_in_order() -> None:
    server = ServerConfig(
        models=("smollm2-135m-instruct", "all-minilm-l6-v2"), served_model_name=("chat",)
    )
    assert [s.name for s in served_sources(server)] == ["chat", "all-minilm-l6-v2"]
    with pytest.raises(ConfigError):  # two models, three names
        ServerConfig(
            models=("smollm2-135m-instruct", "all-minilm-l6-v2"), served_model_name=("a", "b", "c")
        )
    one = ServerConfig(models=("smollm2-135m-instruct",), served_model_name=("a", "b"))
    assert [s.name for s in served_sources(one)] == ["a"]  # "b" is an alias (vLLM's meaning)
    with pytest.raises(ConfigError):
        served_sources(
            ServerConfig(
                models=("smollm2-135m-instruct", "all-minilm-l6-v2"),
                served_model_name=("all-minilm-l6-v2",),
            )
        )


def lm_of(vocab: int, tokenizer_folder: Path) -> Any:
    """What ``customize_tokenizer`` reads of a loaded model: its name, vocabulary size
    and tokenizer (no weights needed)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    return SimpleNamespace(name="m", config=SimpleNamespace(vocab_size=vocab), tokenizer=tokenizer)


def test_a_chat_template_from_a_file_or_a_string_and_a_tokenizer_folder(
    tmp_path: Path, smollm_folder: Path
) -> None:
    lm = lm_of(49152, smollm_folder)
    hello = [{"role": "user", "content": "hi"}]
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    customize_tokenizer(lm, chat_template=str(tmp_path / "t.jinja"))
    assert lm.tokenizer.apply_chat_template(hello, tokenize=False) == "[user] hi\n"
    customize_tokenizer(lm, chat_template="{{ messages[0].content | upper }}")
    assert lm.tokenizer.apply_chat_template(hello, tokenize=False) == "HI"
    with pytest.raises(ConfigError, match="does not parse"):
        customize_tokenizer(lm, chat_template="{% for %}")
    before = lm.tokenizer
    customize_tokenizer(lm, tokenizer=str(smollm_folder))
    assert lm.tokenizer is not before and lm.tokenizer.encode("hello") == [28120]
    small = lm_of(512, smollm_folder)  # a model with a 512-token vocabulary
    with pytest.raises(ConfigError, match="tokens"):
        customize_tokenizer(small, tokenizer=str(smollm_folder))
    with pytest.raises(ConfigError, match="neither a folder"):
        customize_tokenizer(small, tokenizer=str(tmp_path / "nothing"))
