"""A TCP proxy on loopback for the stalled-connection tests: it forwards bytes both ways until
``stall()``, after which every connection open at that moment stays open but carries nothing more
(a partition, a frozen server, a load balancer that stops forwarding). Connections made after the
stall are forwarded again, as a reconnect through another path would be."""

from __future__ import annotations

import select
import socket
import threading


class StallingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.closed = threading.Event()
        self.connections: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self.accepted = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def stall(self) -> None:
        with self._lock:
            for _client, _server, frozen in self.connections:
                frozen.set()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        with self._lock:
            for client, server, _frozen in self.connections:
                client.close()
                server.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            frozen = threading.Event()
            with self._lock:
                self.connections.append((client, server, frozen))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, server, frozen), name="proxy-pump", daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket, frozen: threading.Event) -> None:
        peers = {client: server, server: client}
        while not self.closed.is_set() and not frozen.is_set():
            try:
                readable, _, _ = select.select(list(peers), [], [], 0.2)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        client.close()
                        server.close()
                        return
                    if not frozen.is_set():
                        peers[sock].sendall(data)
            except OSError:
                return
        # Frozen: both sockets stay open and unread until close().
