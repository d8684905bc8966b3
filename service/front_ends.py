"""This process's place among the app's front ends, when the launcher (launcher.py) runs the
app as several processes on one port sharing each engine's core: its index, its peers' Unix
sockets and the run's secret, by which a front end forwards a call naming a chat session to
the one holding it (chat/front_ends.py) and /ready asks every front end (api/ops.py).
"""

from __future__ import annotations

import asyncio
import hmac
import os
from dataclasses import dataclass

import httpx

PEER_HEADER = "x-vchat-peer"  # a request from another front end carries the run's secret


@dataclass(frozen=True)
class FrontEnd:
    """This process's place among the app's front ends (None when it runs alone)."""

    index: int
    count: int
    peers: tuple[str, ...]  # every front end's Unix socket, by index (its own included)
    secret: str  # the header value a peer's forwarded request carries

    @property
    def own_socket(self) -> str:
        return self.peers[self.index]

    @property
    def folder(self) -> str:
        """The run's private folder (only this user can open it): where the sockets are,
        and what the front ends share besides (engine/seats.py)."""
        return os.path.dirname(self.peers[self.index])

    def from_peer(self, given: str | bytes | None) -> bool:
        """Whether a request's PEER_HEADER value is this run's secret: another front end's."""
        given = given.encode() if isinstance(given, str) else (given or b"")
        return hmac.compare_digest(given, self.secret.encode())

    async def ask_peers(self, path: str) -> dict[int, tuple[int, str] | None]:
        """Every other front end's own answer to GET `path`, (status, text) by index; None
        for one that did not answer."""
        async def ask(index: int) -> tuple[int, str] | None:
            transport = httpx.AsyncHTTPTransport(uds=self.peers[index])
            async with httpx.AsyncClient(transport=transport, timeout=10.0) as http:
                try:
                    answer = await http.get(f"http://front-end{path}",
                                            headers={PEER_HEADER: self.secret})
                except httpx.HTTPError:
                    return None
            return answer.status_code, answer.text

        others = [i for i in range(self.count) if i != self.index]
        return dict(zip(others, await asyncio.gather(*[ask(i) for i in others])))


_current: FrontEnd | None = None


def current() -> FrontEnd | None:
    """This process's FrontEnd, when the launcher started it; None for `chainlit run`."""
    return _current


def become(front: FrontEnd) -> None:
    """This process is `front` (the launcher's front-end process, at its start)."""
    global _current
    _current = front
