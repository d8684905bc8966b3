"""The clock of everything the app stores: UTC in Chainlit's format ("...Z", naive, ISO
8601), strictly increasing in this process, so that two steps written one after the other
never share a time (their order in a stored chat is their time's)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone


class OrderedClock:
    """`utc_now()` as Chainlit writes it (naive UTC, ISO 8601, "Z"), strictly increasing."""

    def __init__(self):
        self._last = datetime.min

    def utc_now(self) -> str:
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        if now <= self._last:
            now = self._last + timedelta(microseconds=1)
        self._last = now
        # Always with microseconds: isoformat() leaves them out when they are 0, and such a
        # time would sort after the later ones of the same second.
        return now.isoformat(timespec="microseconds") + "Z"


CLOCK = OrderedClock()
