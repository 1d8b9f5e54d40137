"""``carpool generate``: prompts in, completions out, with the offline step budget
unless a flag gives one; bad flags are refused with the config's message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from carpool import llm as llm_module
from carpool.cli import main
from carpool.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS


def test_generate_prints_one_json_line_per_prompt(
    smollm_folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    budgets = []
    real_init = llm_module.LLM.__init__

    def recording_init(self: llm_module.LLM, model: str, **kwargs: object) -> None:
        real_init(self, model, **kwargs)  # type: ignore[arg-type]
        budgets.append(self.engine.config.max_num_batched_tokens)

    monkeypatch.setattr(llm_module.LLM, "__init__", recording_init)
    argv = ["generate", "--max-tokens", "4", "--json", "--prompt", "The capital of France is"]
    assert main([*argv, "--prompt", "One, two,"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert [line["prompt"] for line in lines] == ["The capital of France is", "One, two,"]
    assert "Paris" in lines[0]["text"]
    assert main([*argv, "--max-num-batched-tokens", "64"]) == 0
    assert budgets == [OFFLINE_MAX_NUM_BATCHED_TOKENS, 64]


def test_a_bad_engine_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "x", "--block-size", "7"]) == 2
    assert "block_size must be" in capsys.readouterr().err


def test_without_a_compiler_generate_warns_that_torch_runs(
    smollm_folder: Path, tmp_path: Path
) -> None:
    """The fallback under ``auto`` is a WARNING that a plain ``carpool generate``
    prints (no logging set up), and the answer is still right."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc")}
    carpool = Path(sys.executable).parent / "carpool"
    argv = [str(carpool), "generate", "--max-tokens", "4", "--prompt", "The capital of France is"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    for part in ("linear layers", "decode attention"):
        assert f"{part}: torch runs instead of a native kernel (" in done.stderr
    assert "no C compiler" in done.stderr
