"""carpool.toml read into a ModelSpec; unknown keys and bad values refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.repository.carpool_config import read_carpool_model
from carpool.repository.errors import RepositoryError

GOOD = """
max_batch_size = 8
isolation = "process"
source = { kind = "python_class", target = "model:M", options = { width = 3 } }
batching = { max_queue_delay_ms = 2.5, preferred_batch_sizes = [4] }
inputs = [{ name = "x", datatype = "INT64", dims = [-1], allow_ragged_batch = true }]
outputs = [{ name = "y", datatype = "FP16", dims = [3] }]
"""


def write(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "carpool.toml").write_text(text)
    return folder


def test_a_class_model(tmp_path: Path) -> None:
    [spec] = read_carpool_model(write(tmp_path, GOOD))
    assert spec.name == "m" and spec.max_batch_size == 8 and spec.isolation == "process"
    assert spec.batching.max_queue_delay_ms == 2.5
    assert spec.batching.preferred_batch_sizes == (4,)
    assert spec.source.target == "model:M" and spec.source.options == {"width": 3}
    assert spec.ragged
    assert spec.model_config["output"][0]["data_type"] == "TYPE_FP16"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("max_batch_size = 8", "max_batch_sise = 8"), "max_batch_sise"),
        (("max_queue_delay_ms", "max_queue_delay"), "max_queue_delay"),
        (('"FP16"', '"FLOAT"'), "FLOAT"),
        (('"python_class"', '"onnx"'), "onnx"),
        (('"model:M"', '"model"'), "module:Class"),
        (('isolation = "process"', 'isolation = "vm"'), "isolation"),
        (("[4]", "[40]"), "preferred batch size"),
        (("max_batch_size = 8", "max_batch_size = 8 ="), "carpool.toml"),
    ],
)
def test_bad_files_are_refused(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    with pytest.raises(RepositoryError, match=message):
        read_carpool_model(write(tmp_path, GOOD.replace(*change)))
