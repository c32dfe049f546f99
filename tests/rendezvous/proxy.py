"""A TCP relay in front of a real etcd that is slow to take new connections, as an etcd swamped by a mass start is.

It accepts one connection every ``gap`` seconds (the others wait in the kernel's listen backlog, their TCP
handshake done, their HTTP/2 one not), and starts relaying a connection's bytes only ``hold`` seconds after
accepting it. Once relaying, it passes every byte both ways unchanged: the etcd behind it is real.
"""

from __future__ import annotations

import socket
import threading
import time


class SlowAcceptProxy:
    """``endpoint`` relays to ``target`` (``host:port``), taking ``gap`` s per accept and ``hold`` s per connection."""

    def __init__(self, target: str, gap: float, hold: float) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.gap, self.hold = gap, hold
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.accepted = 0
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._accept_loop, name="slow-accept", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.close()
            except OSError:
                pass

    def __enter__(self) -> SlowAcceptProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        while not self._stopped.wait(self.gap):
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            self._keep(client)
            threading.Thread(target=self._serve, args=(client, time.monotonic() + self.hold), daemon=True).start()

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _serve(self, client: socket.socket, relay_at: float) -> None:
        if self._stopped.wait(max(0.0, relay_at - time.monotonic())):
            return
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        self._keep(upstream)
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until either ends; then end both."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    for sock in (source, sink):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
