"""A TCP proxy in front of a peer's sshd that cuts connections after N bytes.

`arm(n)` makes the next connection reset both ends once n client->server bytes
have passed (an RST, as a dropped link looks to both sides); unarmed
connections pass through. `disarm()` also cancels the cut of a connection that was
armed but has not carried its n bytes yet (a sync shorter than the cut offset leaves
its login open and warm: a later sync reusing it must not be cut). `arm_live(n)` cuts whichever connection, open or new,
next carries n more client->server bytes: the link under a warm SSH session that
a worker keeps between syncs. Every connection is a thread pair-less pump (select).
"""
from __future__ import annotations

import select
import socket
import struct
import threading

_LINGER_RST = struct.pack("ii", 1, 0)


class CuttingProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.target = (host, target_port)
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self._armed: list[int] = []
        self._live: int | None = None   # client->server bytes left before a live cut
        self._pending: dict[int, int] = {}  # open connection -> its armed cut offset
        self._lock = threading.Lock()
        self.cuts = 0
        self.connections = 0
        self.passed = 0            # client->server bytes of the last connection
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def arm(self, *cut_after: int) -> None:
        """Cut the next len(cut_after) connections, each after its byte count."""
        with self._lock:
            self._armed.extend(cut_after)

    def arm_live(self, cut_after: int) -> None:
        """Cut the connection that carries the next cut_after client->server bytes."""
        with self._lock:
            self._live = cut_after

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()
            self._pending.clear()
            self._live = None

    def _cut_of(self, conn: int) -> int | None:
        with self._lock:
            return self._pending.get(conn)

    def _live_cut(self, n: int) -> int | None:
        """Count n bytes against a live cut; the bytes to forward before cutting, if it is due."""
        with self._lock:
            if self._live is None:
                return None
            if n < self._live:
                self._live -= n
                return None
            left, self._live = self._live, None
            return left

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn = self.connections
            with self._lock:
                if self._armed:
                    self._pending[conn] = self._armed.pop(0)
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                with self._lock:
                    self._pending.pop(conn, None)
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server, conn), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket, conn: int) -> None:
        passed = 0
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.5)
                for src in ready:
                    data = src.recv(1 << 16)
                    if not data:
                        return
                    if src is client:
                        cut = self._cut_of(conn)
                        if cut is not None and passed + len(data) >= cut:
                            server.sendall(data[:cut - passed])
                            passed = cut
                            self.cuts += 1
                            return
                        left = self._live_cut(len(data))
                        if left is not None:
                            server.sendall(data[:left])
                            passed += left
                            self.cuts += 1
                            return
                        passed += len(data)
                        server.sendall(data)
                    else:
                        client.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._pending.pop(conn, None)
            self.passed = passed
            for s in (client, server):
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self._thread.join(timeout=2)
