"""Configuration is validated once, rejects unknown keys, and CLI flags take effect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from carpool import cli
from carpool.cli import build_config, parser
from carpool.config import (
    BatchingConfig,
    CarpoolConfig,
    ConfigError,
    EngineConfig,
    QueuePolicy,
    RuntimeConfig,
    from_dict,
    load_model_batching,
)


def test_unknown_keys_are_rejected_with_the_known_ones_listed() -> None:
    with pytest.raises(ConfigError, match=r"unknown BatchingConfig key\(s\): max_batch.*known:"):
        from_dict(BatchingConfig, {"max_batch": 4})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be >= 1"),
        ({"max_batch_size": 4, "preferred_batch_sizes": [8]}, "preferred batch size 8"),
        ({"priority_levels": 2, "default_priority_level": 3}, "default_priority_level"),
        ({"max_queue_delay_ms": -1}, "max_queue_delay_ms"),
        ({"max_batch_size": "four"}, "expects int"),
    ],
)
def test_bad_values_fail_with_a_clear_message(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(BatchingConfig, data)


def test_cli_flags_reach_the_config() -> None:
    args = parser().parse_args(
        [
            "serve",
            "--port",
            "0",
            "--max-batch-size",
            "8",
            "--max-queue-delay-ms",
            "5",
            "--preferred-batch-sizes",
            "4",
            "8",
            "--max-queue-size",
            "3",
            "--no-allow-timeout-override",
            "--switch-interval-ms",
            "2",
            "--model",
            "a",
            "--model",
            "b",
        ]
    )
    config = build_config(args)
    assert config.server.port == 0 and config.server.models == ("a", "b")
    assert config.runtime.switch_interval_ms == 2.0
    assert config.batching.max_batch_size == 8 and config.batching.max_queue_delay_ms == 5.0
    assert config.batching.preferred_batch_sizes == (4, 8)
    assert config.batching.queue_policy == QueuePolicy(
        max_queue_size=3, allow_timeout_override=False
    )


def test_per_model_config_file_overrides_the_shared_batching(tmp_path: Path) -> None:
    path = tmp_path / "models.json"
    path.write_text(
        json.dumps(
            {
                "models": {
                    "m": {
                        "max_batch_size": 2,
                        "priority_queue_policy": {"1": {"max_queue_size": 5}},
                    }
                }
            }
        )
    )
    batching = load_model_batching(path)
    assert batching["m"].max_batch_size == 2
    assert batching["m"].policy_for(1).max_queue_size == 5
    config = build_config(parser().parse_args(["serve", "--model-config", str(path)]))
    assert config.batching_for("m").max_batch_size == 2
    assert config.batching_for("other") == BatchingConfig()
    path.write_text(json.dumps({"models": {"m": {"max_batch_sise": 2}}}))
    with pytest.raises(ConfigError, match="max_batch_sise"):
        load_model_batching(path)


def test_async_scheduling_unset_is_on_for_a_gpu_unless_drafts_are_asked_for() -> None:
    unset = EngineConfig()
    assert unset.async_scheduling is None
    assert unset.for_device("cuda").async_scheduling is True
    assert unset.for_device("cpu").async_scheduling is False
    assert EngineConfig(num_scheduler_steps=8).for_device("cuda").async_scheduling is False
    ngram = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    assert ngram.for_device("cuda").async_scheduling is False
    assert EngineConfig(async_scheduling=True).for_device("cpu").async_scheduling is True
    assert EngineConfig(async_scheduling=False).for_device("cuda").async_scheduling is False
    with pytest.raises(ConfigError, match="does not combine"):
        EngineConfig(async_scheduling=True, num_scheduler_steps=8)


def test_a_config_resolved_for_its_device_keeps_no_sentinel_and_resolves_once() -> None:
    cpu = EngineConfig().for_device("cpu")
    assert (cpu.max_num_batched_tokens, cpu.dtype, cpu.async_scheduling) == (192, "float32", False)
    gpu = EngineConfig().for_device("cuda")
    assert (gpu.max_num_batched_tokens, gpu.dtype, gpu.async_scheduling) == (2048, "bfloat16", True)
    asked = EngineConfig(max_num_batched_tokens=512, dtype="float16").for_device("cuda")
    assert (asked.max_num_batched_tokens, asked.dtype) == (512, "float16")
    assert gpu.for_device("cpu") == gpu  # a resolved config stays as it was resolved
    whole = CarpoolConfig(runtime=RuntimeConfig(device="cuda")).resolved()
    assert whole.engine == gpu and whole.runtime.engine_process is True
    assert CarpoolConfig().resolved().runtime.engine_process is False


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)],
)
def test_the_async_scheduling_flag_sets_it_or_leaves_it_unset(
    flags: list[str], expected: bool | None
) -> None:
    config = build_config(parser().parse_args(["serve", "--model", "a", *flags]))
    assert config.engine.async_scheduling is expected


def test_an_optional_field_from_a_file_is_checked_as_its_type() -> None:
    assert from_dict(EngineConfig, {"async_scheduling": None}).async_scheduling is None
    assert from_dict(EngineConfig, {"async_scheduling": True}).async_scheduling is True
    with pytest.raises(ConfigError, match=r"EngineConfig.async_scheduling expects bool"):
        from_dict(EngineConfig, {"async_scheduling": "yes"})


def test_every_commands_help_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Field docstrings become the help: one holding "%" once made ``serve --help``
    crash in argparse's formatting."""
    helps = cli.field_help
    monkeypatch.setattr(
        cli, "field_help", lambda cls: {k: f"{v} (9-44% more)" for k, v in helps(cls).items()}
    )
    for command in ("serve", "generate", "bench"):
        with pytest.raises(SystemExit) as done:
            parser().parse_args([command, "--help"])
        assert done.value.code == 0
    assert "9-44% more" in " ".join(capsys.readouterr().out.split())


def test_engine_process_unset_is_on_for_a_gpu_only() -> None:
    assert RuntimeConfig(device="cuda").resolved().engine_process is True
    assert RuntimeConfig().resolved().engine_process is False
    assert RuntimeConfig(engine_process=True).resolved().engine_process is True
    assert RuntimeConfig(device="cuda", engine_process=False).resolved().engine_process is False
    args = parser().parse_args(["serve", "--device", "cuda", "--no-engine-process"])
    assert build_config(args).runtime.engine_process is False
