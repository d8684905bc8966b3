"""Helpers shared by tests/ and bench/ (not part of the app): a headless Chainlit client
and a tiny random-weight Qwen3 checkpoint."""
