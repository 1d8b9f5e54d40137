"""A ``vllm serve`` command line read by ``carpool serve``: the positional model,
the flags both share, and vLLM's own mapped to carpool's meaning or refused with
what to use instead."""

from __future__ import annotations

import pytest

from carpool.cli import build_config, parser
from carpool.config import ConfigError
from carpool.server.bootstrap import model_aliases


def config_of(*argv: str):  # type: ignore[no-untyped-def]
    return build_config(parser().parse_args(["serve", *argv]))


def test_a_vllm_command_line_is_read_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    config = config_of(
        "Qwen/Qwen3-0.6B",
        "--served-model-name", "a", "b",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--max-model-len", "8192", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
        "--gpu-memory-utilization", "0.8", "--dtype", "half", "--api-key", "k",
        "--reasoning-parser", "qwen3", "--enable-prefix-caching", "--generation-config", "vllm",
        "--tensor-parallel-size", "1", "--trust-remote-code", "--disable-log-requests",
    )  # fmt: skip
    assert config.server.models == ("Qwen/Qwen3-0.6B",)
    assert model_aliases(config.server) == {"b": "a"}
    engine = config.engine
    assert (engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens) == (
        8192,
        64,
        4096,
    )
    assert engine.dtype == "float16" and engine.enable_prefix_caching is True
    assert config.server.api_key == "k" and config.server.generation_config == "vllm"
    assert "runs no code" in capsys.readouterr().err


def test_the_positional_model_comes_first_beside_model_flags() -> None:
    assert config_of("m1", "--model", "m2").server.models == ("m1", "m2")
    assert config_of("--model", "m2").server.models == ("m2",)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tensor-parallel-size", "2"], "--replicas"),
        (["--tool-call-parser", "mistral"], "leave the flag out"),
    ],
)
def test_what_carpool_cannot_honour_is_refused_with_what_to_use(
    flags: list[str], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        config_of("m", *flags)


def test_several_names_are_aliases_only_for_one_model() -> None:
    assert model_aliases(config_of("m", "--served-model-name", "x").server) == {}
    two = config_of("--model", "m1", "--model", "m2", "--served-model-name", "x", "y").server
    assert model_aliases(two) == {}
    with pytest.raises(ConfigError, match="names for 2 models"):
        config_of("--model", "m1", "--model", "m2", "--served-model-name", "x", "y", "z")
