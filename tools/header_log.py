"""A test part for a real `vllm serve`: `--middleware tools.header_log.record` writes, for
every request, its path and its X- headers as one JSON line to `log_path(port)`, the port
being the server's own (the server's log shows no headers). The tests read it to see
which server a request reached and with what session key (tests/test_deploy.py).
"""

from __future__ import annotations

import json
from pathlib import Path

FOLDER = Path(__file__).resolve().parent.parent / ".cache"


def log_path(port: int) -> Path:
    return FOLDER / f"vllm-requests-{port}.jsonl"


async def record(request, call_next):
    headers = {k.lower(): v for k, v in request.headers.items() if k.lower().startswith("x-")}
    line = json.dumps({"path": request.url.path, "headers": headers})
    with log_path(request.scope["server"][1]).open("a") as log:  # one short write each
        log.write(line + "\n")
    return await call_next(request)


def read(path: Path) -> list[dict]:
    """The requests recorded so far, oldest first."""
    try:
        with open(path) as log:
            return [json.loads(line) for line in log if line.strip()]
    except FileNotFoundError:
        return []
