"""A real python-socketio server with one connected socket and no transport, for measuring
and testing what sending an event costs: what is sent waits on the socket's queue."""

from __future__ import annotations

import socketio
from engineio.async_socket import AsyncSocket

from chat import emits


async def socket_server(in_line: bool):
    """(server, the socket's sid, its Engine.IO socket); `in_line`: with chat/emits.py
    installed."""
    sio = socketio.AsyncServer(async_mode="asgi")
    if in_line:
        emits.install(sio)
    eio_socket = AsyncSocket(sio.eio, "eio-1")
    sio.eio.sockets["eio-1"] = eio_socket
    sid = await sio.manager.connect("eio-1", "/")
    return sio, sid, eio_socket
