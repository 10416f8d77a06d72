"""The agent endpoint's connections: a cap on how many, and on how long a request's headers may take.

The endpoint listens on a local port that every process of the machine can reach, with or without
the token (docs/agents.md, "Security model"). Without limits, idle connections from another process
use up the runner's file descriptors (new command agents then fail with ``EMFILE``) and one huge
header is buffered whole before the 401. So the server speaks HTTP/1.1 through h11 (uvicorn's
``http="h11"``), whose parser refuses a request line and headers past ``max_incomplete_event_size``
with a 400 before it buffers more, and each connection is a :class:`GuardedH11Protocol`:

* **at most ``max_connections`` open**: a connection past the cap closes an idle one (no request in
  flight) to make room, the oldest of those that never got an answer first (a caller without the
  token gets only 401s, which close their connection), else the oldest idle one; when every open
  connection has a request in flight, the new one is closed at once. So a flood of idle sockets
  costs at most the cap in descriptors and never locks out an agent;
* **a request's headers within ``request_timeout_s``** of the connection's opening or of the end of
  its previous answer (a slow sender of headers, "slowloris", is closed), besides uvicorn's own
  ``timeout_keep_alive`` for a connection that sends nothing after an answer.

What a connection costs is counted in :class:`ConnectionStats` (the server's ``connection_stats``);
the h11 parser's refusals ("Invalid HTTP request received.") are counted there, not logged per
connection, so a flood does not flood the runner's log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ConnectionLimits", "ConnectionStats", "guarded_protocol"]

logger = logging.getLogger("flashrl.agents")


@dataclass(frozen=True)
class ConnectionLimits:
    """What one endpoint allows its callers before any request is read."""

    max_connections: int = 128
    """Open connections; one past it closes an idle one (or itself, when none is idle)."""
    max_header_bytes: int = 64 * 1024
    """A request line and headers (the ``openai`` client sends about 1 KiB); past it: HTTP 400, closed."""
    request_timeout_s: float = 10.0
    """Time for a request's headers (from the connection's opening or the previous answer), and for its body."""
    keep_alive_s: float = 5.0
    """An idle connection after an answer is closed after this (uvicorn's ``timeout_keep_alive``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1; got {self.max_connections!r}.")
        if not isinstance(self.max_header_bytes, int) or self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be an int >= 1024; got {self.max_header_bytes!r}.")
        for name in ("request_timeout_s", "keep_alive_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number > 0; got {value!r}.")


@dataclass
class ConnectionStats:
    """What the endpoint's connections did (counts since start)."""

    opened: int = 0
    evicted: int = 0
    """Idle connections closed to make room for a new one (past ``max_connections``)."""
    refused: int = 0
    """New connections closed at once: the cap was reached and every open connection was busy."""
    header_timeouts: int = 0
    """Connections closed because a request's headers did not arrive within ``request_timeout_s``."""
    bad_http: int = 0
    """Requests the HTTP parser refused (oversized or malformed request line or headers): HTTP 400, closed."""


def _not_bad_http(record: logging.LogRecord) -> bool:
    return record.msg != "Invalid HTTP request received."


_CONNECTION_LOG = logging.getLogger("uvicorn.error.flashrl_agents")
"""uvicorn's connection logger for the guarded connections (a child: same handlers and level), without
the parser's per-request warning, which `ConnectionStats.bad_http` counts."""
_CONNECTION_LOG.addFilter(_not_bad_http)


def guarded_protocol(limits: ConnectionLimits, stats: ConnectionStats) -> type[H11Protocol]:
    """The protocol class of one endpoint (``uvicorn.Config(http=...)``), bound to its limits and counts."""
    order = itertools.count()

    class GuardedH11Protocol(H11Protocol):
        """uvicorn's h11 connection, with the cap on connections and the header time (module doc)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.logger = _CONNECTION_LOG
            self._opened_at = next(order)
            self._answered = 0
            self._header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            stats.opened += 1
            self._arm_header_timer()
            if len(self.connections) > limits.max_connections:
                victim = _idle_victim(self.connections, self)
                if victim is None:
                    stats.refused += 1
                    self._close()
                else:
                    stats.evicted += 1
                    victim._close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.busy:  # a request's headers arrived: its body and answer are the app's to time
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            self._answered += 1
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def send_400_response(self, msg: str) -> None:
            stats.bad_http += 1
            super().send_400_response(msg)

        @property
        def busy(self) -> bool:
            """Whether a request is in flight (its headers read, its answer not complete)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.request_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.busy and not self.transport.is_closing():
                stats.header_timeouts += 1
                self._close()

        def _close(self) -> None:
            self._disarm_header_timer()
            self._unset_keepalive_if_required()
            self.transport.abort()  # no lingering close: the descriptor goes now

    return GuardedH11Protocol


def _idle_victim(connections: set[Any], newcomer: Any) -> Any | None:
    """The connection to close for ``newcomer``: the oldest idle one that never got an answer, else the
    oldest idle one; None when all are busy."""
    idle = [c for c in connections if c is not newcomer and not c.busy and not c.transport.is_closing()]
    if not idle:
        return None
    return min(idle, key=lambda c: (c._answered > 0, c._opened_at))
