"""HTTP APIs beside the chat UI (openai.py: the OpenAI-compatible one)."""
