"""Text Generation Inference's API, an adapter over the completions path."""
