"""The peer interface over a local receiver process, for tests and same-host pools.

The receiver is started through drsvc.runner.spawn and connects back to a
private unix socket, which carries the protocol both ways like an SSH channel.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import runner
from ..errors import PeerUnreachable
from . import Channel, Peer

_BUF = 1 << 20


class LocalChannel(Channel):
    def __init__(self, sock: socket.socket, proc: subprocess.Popen, name: str):
        self.sock, self.proc, self.name = sock, proc, name
        self.bytes_sent = 0
        self.broken = False     # a send failed: the receiver closed its end

    def send(self, data) -> None:
        try:
            self.sock.sendall(data)
        except OSError as e:
            self.broken = True
            raise PeerUnreachable(peer=self.name, reason=f"receiver connection lost: {e}") from None
        self.bytes_sent += len(data)

    def recv(self, n: int) -> bytes:
        try:
            return self.sock.recv(min(n, _BUF))
        except TimeoutError:
            raise PeerUnreachable(peer=self.name, reason="receiver did not answer in time") from None
        except OSError as e:
            raise PeerUnreachable(peer=self.name, reason=f"receiver connection lost: {e}") from None

    def close_write(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def alive(self) -> bool:
        """False once a send failed (the receiver closed its end) or the receiver exited. A
        read may still wait: a stripe's socket can be held open by the master it joined
        (``buffered`` says whether it would)."""
        return not self.broken and self.proc.poll() is None

    def buffered(self) -> bool:
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):       # closed here
            return True

    def exit_status(self, timeout: float = 5.0):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


class LocalPeer(Peer):
    def __init__(self, pool, *, name: str = "local", python: str | None = None,
                 env: dict | None = None, timeout: float = 300.0):
        self.pool = Path(pool)
        self.name = name
        self.python = python or sys.executable
        self.env = env
        self.timeout = timeout
        self.last_proc: subprocess.Popen | None = None

    def open(self, verb: str, *args: str) -> LocalChannel:
        tmp = tempfile.mkdtemp(prefix="drsvc-local-")
        path = os.path.join(tmp, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(0.2)
            words = ("--pool", self.pool, "--connect", path, verb, *args)
            env = {**os.environ, **(self.env or {})}
            if self.python == sys.executable:
                argv, env["PYTHONPATH"] = runner.module_without_site(
                    "drsvc.replication.receiver", *words, first=(self.env or {}).get("PYTHONPATH"))
            else:       # another interpreter: its own site and environment
                argv = [self.python, "-m", "drsvc.replication.receiver", *words]
            proc = runner.spawn(argv, env=env)
            self.last_proc = proc
            waited = 0.0
            while True:
                try:
                    sock, _ = listener.accept()
                    break
                except TimeoutError:
                    waited += 0.2
                    if proc.poll() is not None or waited > 30:
                        proc.kill()
                        raise PeerUnreachable(peer=self.name, reason="receiver did not start") from None
        finally:
            listener.close()
            try:
                os.unlink(path)
                os.rmdir(tmp)
            except OSError:
                pass
        sock.settimeout(self.timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUF)
        return LocalChannel(sock, proc, self.name)
