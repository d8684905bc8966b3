"""Helpers shared by tests/ and bench/ (not part of the app): a headless Chainlit client."""
