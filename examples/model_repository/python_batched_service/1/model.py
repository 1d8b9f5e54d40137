"""Triton's Python-backend example with dynamic batching, served by carpool unchanged.

Each request's ``input_field`` (FP32, shape [batch, n]) comes back doubled as
``output_field``; ``execute`` receives every request of the batch at once, as
Triton's dynamic batcher hands them over.
"""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        output_config = pb_utils.get_output_config_by_name(self.model_config, "output_field")
        self.output_dtype = pb_utils.triton_string_to_numpy(output_config["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "input_field").as_numpy()
            doubled = (values * 2).astype(self.output_dtype)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("output_field", doubled)]
                )
            )
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("python_batched_service: finalize")
