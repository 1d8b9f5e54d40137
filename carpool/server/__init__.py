"""The HTTP edge: OpenAI /v1, Open Inference Protocol /v2, metrics."""
