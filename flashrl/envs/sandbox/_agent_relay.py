"""The endpoint's relay inside a sandboxed command agent's net namespace (standard library only).

The in-sandbox launcher (``_launcher.py``, agent mode) imports it by path and calls :func:`start` before
it confines itself: a process of its own listens on ``127.0.0.1:PORT`` (the endpoint's port, so the
agent's ``OPENAI_BASE_URL`` is the runner's, unchanged) and forwards every connection to the unix socket
the runner serves the endpoint on, bound into the sandbox. The namespace holds nothing else: loopback
and this listener are the agent's whole network (`flashrl.envs.sandbox.agent_command`).
"""

from __future__ import annotations

import os
import selectors
import socket

_CHUNK = 1 << 16


def start(port: int, socket_path: str) -> int:
    """Listen on ``127.0.0.1:port`` now (so the agent never races the relay), then serve in a child process;
    the child's pid. The child ends with the sandbox's pid namespace."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    pid = os.fork()
    if pid == 0:
        try:
            _serve(listener, socket_path)
        finally:
            os._exit(0)
    listener.close()
    return pid


def _serve(listener: socket.socket, socket_path: str) -> None:
    """Pump bytes both ways between each accepted TCP connection and a unix connection of its own; a side's
    EOF is passed on as a half-close, and a pair is closed once both sides ended (or one failed)."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    peers: dict[socket.socket, socket.socket] = {}
    ended: set[socket.socket] = set()
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            if sock is listener:
                client, _ = listener.accept()
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    upstream.connect(socket_path)
                except OSError:
                    client.close()
                    upstream.close()
                    continue
                peers[client], peers[upstream] = upstream, client
                sel.register(client, selectors.EVENT_READ)
                sel.register(upstream, selectors.EVENT_READ)
                continue
            other = peers[sock]
            try:
                data = sock.recv(_CHUNK)
                if data:
                    other.sendall(data)
                    continue
                other.shutdown(socket.SHUT_WR)
            except OSError:
                ended.add(other)
            try:
                sel.unregister(sock)
            except KeyError:
                pass
            ended.add(sock)
            if other in ended:
                for end in (sock, other):
                    try:
                        sel.unregister(end)  # the failed side's peer may still be registered
                    except KeyError:
                        pass
                    peers.pop(end, None)
                    ended.discard(end)
                    end.close()
