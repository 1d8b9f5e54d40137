"""OpenAI's chat, completions and embeddings routes, and vLLM's extras."""
