"""Anthropic's Messages API, an adapter over the chat path."""
