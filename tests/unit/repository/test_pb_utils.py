"""The shim of Triton's ``triton_python_backend_utils`` as Triton's own examples use it."""

from __future__ import annotations

import json

import numpy as np

from carpool.repository import pb_utils


def test_a_bls_target_named_in_bytes_is_the_same_name() -> None:
    """Triton's bls example reads the target's name from a BYTES tensor: bytes."""
    names = np.array([b"add_sub"], dtype=np.object_)
    request = pb_utils.InferenceRequest(
        model_name=names[0],
        requested_output_names=[b"OUTPUT0", "OUTPUT1"],
        inputs=[pb_utils.Tensor("INPUT0", np.ones(4, np.float32))],
    )
    assert request.model_name() == "add_sub"
    assert request.requested_output_names() == ["OUTPUT0", "OUTPUT1"]


def test_the_decoupled_policy_is_read_from_the_model_config() -> None:
    decoupled = json.loads('{"model_transaction_policy": {"decoupled": true}}')
    assert pb_utils.using_decoupled_model_transaction_policy(decoupled)
    assert not pb_utils.using_decoupled_model_transaction_policy({"max_batch_size": 0})
    assert not pb_utils.using_decoupled_model_transaction_policy(
        {"model_transaction_policy": {"decoupled": False}}
    )


def test_a_response_keeps_its_parameters_as_triton_gives_them_back() -> None:
    out = pb_utils.Tensor("OUT", np.ones(1, np.float32))
    given = pb_utils.InferenceResponse([out], parameters={"key": "value", "n": 2})
    assert json.loads(given.parameters()) == {"key": "value", "n": 2}
    as_text = pb_utils.InferenceResponse([out], parameters='{"a": true}')
    assert json.loads(as_text.parameters()) == {"a": True}
    assert pb_utils.InferenceResponse([out]).parameters() == "{}"
