"""The HTTP API: Anthropic Messages, OpenAI chat completions, the direct agent API, admin, health, metrics."""
