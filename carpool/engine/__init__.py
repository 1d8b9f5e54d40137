"""Text generation: continuous batching over a paged KV cache."""
