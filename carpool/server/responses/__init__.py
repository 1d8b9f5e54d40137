"""OpenAI's Responses API, an adapter over the chat path."""
