"""What every text-generation protocol shares: request schemas, prompts and sampling,
tool calls and reasoning read from replies."""
