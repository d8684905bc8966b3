"""What the chat (chat/, on Chainlit) and the OpenAI API (api/) share, free of either's UI:
one turn's course (turn.py), the check of a user's message (input.py), the turns' metrics
and log lines (turn_metrics.py), graceful shutdown (shutdown.py), and what keeps the event
loop that every session shares from stalling (loop.py). Above engine/, below the front
ends; never imports Chainlit.
"""
