"""Triton's config.pbtxt read into a ModelSpec: the knobs honoured, the rest refused
by name."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from carpool.repository.errors import RepositoryError
from carpool.repository.triton_config import (
    NO_TIMEOUT_S,
    UNLIMITED_QUEUE,
    is_triton_model,
    read_triton_model,
)

BASE = """
    name: "m"
    backend: "python"
    max_batch_size: 16
    input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
    output [ { name: "y" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def model(tmp_path: Path, config: str, versions: tuple[int, ...] = (1,)) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.pbtxt").write_text(textwrap.dedent(config))
    for v in versions:
        (folder / str(v)).mkdir()
        (folder / str(v) / "model.py").write_text("")
    return folder


def test_every_dynamic_batching_knob(tmp_path: Path) -> None:
    folder = model(
        tmp_path,
        BASE
        + """
        dynamic_batching {
          preferred_batch_size: [ 4, 8 ]
          max_queue_delay_microseconds: 1500
          priority_levels: 3
          default_priority_level: 2
          default_queue_policy { max_queue_size: 7 default_timeout_microseconds: 2000000
                                 allow_timeout_override: true timeout_action: REJECT }
          priority_queue_policy { key: 1 value: { max_queue_size: 0 } }
        }
        instance_group [ { count: 2 kind: KIND_CPU }, { count: 1 } ]
        """,
    )
    [spec] = read_triton_model(folder)
    b = spec.batching
    assert (b.max_batch_size, b.preferred_batch_sizes, b.max_queue_delay_ms) == (16, (4, 8), 1.5)
    assert (b.priority_levels, b.default_priority_level) == (3, 2)
    assert b.queue_policy.max_queue_size == 7
    assert b.queue_policy.default_timeout_s == 2.0
    assert b.queue_policy.allow_timeout_override
    assert b.priority_queue_policy[1].max_queue_size == UNLIMITED_QUEUE
    assert b.priority_queue_policy[1].default_timeout_s == NO_TIMEOUT_S
    assert spec.instance_count == 3
    assert spec.inputs[0].dims == (-1, 4)
    assert spec.outputs[0].datatype == "BYTES"
    assert spec.model_config["input"][0]["dims"] == [-1, 4]  # ints, as Triton's JSON


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ("sequence_batching { }", "sequence_batching"),
        ("ensemble_scheduling { }", "ensemble_scheduling"),
        ("model_warmup [ { name: \"w\" } ]", "model_warmup"),
        ("response_cache { enable: true }", "response_cache"),
        ("instance_group [ { count: 1 kind: KIND_GPU } ]", "KIND_GPU"),
        ("dynamic_batching { default_queue_policy { timeout_action: DELAY } }", "DELAY"),
        ("input [ { name: \"z\" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } } ]",
         "input.reshape"),
        ("output [ { name: \"w\" data_type: TYPE_FP32 dims: [ 1 ] label_filename: \"l\" } ]",
         "output.label_filename"),
    ],
)  # fmt: skip
def test_unsupported_fields_are_named(tmp_path: Path, extra: str, named: str) -> None:
    folder = model(tmp_path, BASE + extra)
    with pytest.raises(RepositoryError, match=named):
        read_triton_model(folder)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (BASE.replace('backend: "python"', 'backend: "tensorrt"'), "backend 'tensorrt'"),
        (BASE.replace('name: "m"', 'name: "other"'), "differs from its folder"),
        (BASE + "dynamic_batching { preferred_batch_size: [ 32 ] }", "preferred batch size"),
        (BASE.replace("TYPE_FP32", "TYPE_COMPLEX"), "TYPE_COMPLEX"),
        (BASE + "max_batch_sise: 3", "max_batch_sise"),  # a typo: the parser's own error
        (BASE.replace("dims: [ -1, 4 ]", "dims: [ 0 ]"), "dims"),
    ],
)
def test_bad_configs_are_refused(tmp_path: Path, config: str, message: str) -> None:
    with pytest.raises(RepositoryError, match=message):
        read_triton_model(model(tmp_path, config))


def test_version_policies(tmp_path: Path) -> None:
    folder = model(tmp_path, BASE, versions=(1, 2, 3))
    assert [s.version for s in read_triton_model(folder)] == [3]
    config = folder / "config.pbtxt"
    config.write_text(config.read_text() + "version_policy { all { } }")
    assert [s.version for s in read_triton_model(folder)] == [1, 2, 3]
    config.write_text(BASE + "version_policy { specific { versions: [ 1, 3 ] } }")
    assert [s.version for s in read_triton_model(folder)] == [1, 3]
    config.write_text(BASE + "version_policy { latest { num_versions: 2 } }")
    assert [s.version for s in read_triton_model(folder)] == [2, 3]
    config.write_text(BASE + "version_policy { specific { versions: [ 4 ] } }")
    with pytest.raises(RepositoryError, match="version 4"):
        read_triton_model(folder)


def test_without_dynamic_batching_each_request_runs_alone(tmp_path: Path) -> None:
    [spec] = read_triton_model(model(tmp_path, BASE))
    assert not spec.dynamic_batching


def with_hook(tmp_path: Path, config: str, body: str) -> Path:
    """A model whose ``auto_complete_config`` runs ``body`` (``c``: the config)."""
    folder = model(tmp_path, config)
    hook = textwrap.indent(textwrap.dedent(body), " " * 8)
    (folder / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(c):\n"
        f"{hook}\n"
        "        return c\n"
    )
    return folder


def test_auto_complete_fills_in_a_minimal_config(tmp_path: Path) -> None:
    folder = with_hook(
        tmp_path,
        'backend: "python"',
        """\
        assert c.as_dict()["input"] == [] and c.as_dict()["max_batch_size"] == 0
        c.add_input({"name": "x", "data_type": "TYPE_INT64", "dims": [-1]})
        c.add_output({"name": "y", "data_type": "TYPE_FP32", "dims": [2]})
        c.set_max_batch_size(8)
        c.set_dynamic_batching()
        """,
    )
    [spec] = read_triton_model(folder)
    assert spec.max_batch_size == 8 and spec.dynamic_batching
    assert [(t.name, t.datatype, t.dims) for t in spec.inputs] == [("x", "INT64", (-1,))]
    assert spec.model_config["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}]
    with pytest.raises(RepositoryError, match="at least one input"):
        read_triton_model(folder, complete=False)  # the file alone


def test_a_folder_with_only_its_model_file_is_a_model_auto_complete_configures(
    tmp_path: Path,
) -> None:
    """Triton's minimal model configuration (its auto_complete example): no
    config.pbtxt at all, the model named by its folder."""
    folder = with_hook(
        tmp_path,
        'backend: "python"',
        """\
        c.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        c.add_output({"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        c.set_max_batch_size(4)
        """,
    )
    (folder / "config.pbtxt").unlink()
    assert is_triton_model(folder)
    [spec] = read_triton_model(folder)
    assert spec.name == folder.name and spec.max_batch_size == 4
    assert [t.name for t in spec.inputs] == ["INPUT0"]
    assert spec.model_config["backend"] == "python"
    (folder / "carpool.toml").write_text("")  # carpool's own config: not Triton's then
    assert not is_triton_model(folder)
    empty = tmp_path / "no_model"
    (empty / "1").mkdir(parents=True)
    assert not is_triton_model(empty)  # a version folder without model.py is nothing


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("c.set_max_batch_size(4)", "max_batch_size 16"),
        ('c.add_input({"name": "x", "data_type": "TYPE_INT8"})', "auto-complete gave 'TYPE_INT8'"),
        ('c.add_input({"name": "z", "dims": "three"})', "malformed configuration"),
        ('raise RuntimeError("no weights")', "auto_complete_config failed: RuntimeError"),
        ("c = 3", "returned a int"),
        ('c.add_model_warmup({"name": "w"})', "model_warmup"),
    ],
)
def test_auto_complete_that_conflicts_or_fails_is_a_load_error(
    tmp_path: Path, body: str, message: str
) -> None:
    with pytest.raises(RepositoryError, match=message):
        read_triton_model(with_hook(tmp_path, BASE, body))


def test_a_decoupled_model_is_read_in_either_isolation(tmp_path: Path) -> None:
    config = BASE + "model_transaction_policy { decoupled: true }"
    [spec] = read_triton_model(model(tmp_path, config), complete=False)
    assert spec.decoupled
    process = config + ' parameters { key: "isolation" value: { string_value: "process" } }'
    (tmp_path / "m" / "config.pbtxt").write_text(process)
    [spec] = read_triton_model(tmp_path / "m", complete=False)
    assert spec.decoupled and spec.isolation == "process"
