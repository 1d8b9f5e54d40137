"""What a user changes about a model at start-up: the names models are served under
(--served-model-name), their tokenizer (--tokenizer) and chat template
(--chat-template, a file or the template itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.config import ConfigError, ServerConfig
from carpool.models.causal_lm import customize_tokenizer, load_causal_lm
from carpool.server.bootstrap import served_sources
from tests import tiny_models

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_models_are_served_under_the_names_given_in_order() -> None:
    server = ServerConfig(
        models=("smollm2-135m-instruct", "all-minilm-l6-v2"), served_model_name=("chat",)
    )
    assert [s.name for s in served_sources(server)] == ["chat", "all-minilm-l6-v2"]
    with pytest.raises(ConfigError):
        ServerConfig(models=("smollm2-135m-instruct",), served_model_name=("a", "b"))
    with pytest.raises(ConfigError):
        served_sources(
            ServerConfig(
                models=("smollm2-135m-instruct", "all-minilm-l6-v2"),
                served_model_name=("all-minilm-l6-v2",),
            )
        )


def test_a_chat_template_from_a_file_or_a_string_and_a_tokenizer_folder(
    tmp_path: Path, smollm_folder: Path
) -> None:
    tiny_models.build("llama", tmp_path / "m", smollm_folder, vocab=49152)
    lm = load_causal_lm(tmp_path / "m", progress=False)
    hello = [{"role": "user", "content": "hi"}]
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    customize_tokenizer(lm, chat_template=str(tmp_path / "t.jinja"))
    assert lm.tokenizer.apply_chat_template(hello, tokenize=False) == "[user] hi\n"
    customize_tokenizer(lm, chat_template="{{ messages[0].content | upper }}")
    assert lm.tokenizer.apply_chat_template(hello, tokenize=False) == "HI"
    with pytest.raises(ConfigError, match="does not parse"):
        customize_tokenizer(lm, chat_template="{% for %}")
    customize_tokenizer(lm, tokenizer=str(smollm_folder))
    assert lm.tokenizer.encode("hello") == [28120]  # the built-in model's tokenizer
    small = tmp_path / "small"
    tiny_models.build("llama", small, smollm_folder)  # a 512-token vocabulary
    small_lm = load_causal_lm(small, progress=False)
    with pytest.raises(ConfigError, match="tokens"):
        customize_tokenizer(small_lm, tokenizer=str(smollm_folder))
    with pytest.raises(ConfigError, match="neither a folder"):
        customize_tokenizer(small_lm, tokenizer=str(tmp_path / "nothing"))
