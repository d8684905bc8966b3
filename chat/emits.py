"""A socket event for one browser goes out in line, not through a task of its own.

python-socketio 5.16's `AsyncManager.emit` makes a task per recipient and waits for them
with `asyncio.wait`, also for Chainlit's events, which each go to one socket (`to=sid`):
every event then costs the coroutine that sends it two turns of the event loop that all
sessions share, and the loop a task. A turn's path from the message to the engine sends
several (Chainlit's task_start, the Regenerate button's removal) and its first token one
more; on a busy loop each turn is milliseconds long (BENCHMARKS.md, "2026-12-03: what
holds Latency-first's first token", item 7). Sending to one socket is a put on its queue,
which never waits, so `install(sio)` sends it in line; events for several sockets, or
asking for an acknowledgement, go the usual way.
"""

from __future__ import annotations

import logging

from engineio import packet as eio_packet
from socketio import packet

log = logging.getLogger(__name__)


def install(sio) -> None:
    """Idempotent."""
    if installed(sio):
        return
    manager = sio.manager
    usual = manager.emit

    async def emit(event, data, namespace, room=None, skip_sid=None, callback=None,
                   to=None, **kwargs):
        room = to or room
        one = None
        if callback is None and skip_sid is None and isinstance(room, str) and \
                namespace in manager.rooms:
            recipients = list(manager.get_participants(namespace, room))
            one = recipients[0][1] if len(recipients) == 1 else None
        if one is None:
            return await usual(event, data, namespace, room=room, skip_sid=skip_sid,
                               callback=callback, **kwargs)
        args = list(data) if isinstance(data, tuple) else [] if data is None else [data]
        encoded = manager.server.packet_class(packet.EVENT, namespace=namespace,
                                              data=[event, *args]).encode()
        for part in encoded if isinstance(encoded, list) else [encoded]:
            try:
                await manager.server._send_eio_packet(
                    one, eio_packet.Packet(eio_packet.MESSAGE, part))
            except Exception as exc:  # the socket closed meanwhile: the sender goes on,
                log.debug("socket event %s not sent: %r", event, exc)  # as with a task
                return

    emit.in_line = True
    manager.emit = emit


def installed(sio) -> bool:
    return getattr(sio.manager.emit, "in_line", False)
