"""Text Embeddings Inference's API, over the embedding and task paths."""
