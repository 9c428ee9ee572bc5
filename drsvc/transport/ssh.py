"""The peer interface over SSH (paramiko). The only module that imports paramiko.

* Host keys are pinned from a per-peer known_hosts file and checked with
  RejectPolicy: an unknown or changed key is refused, typed.
* Authentication uses one dedicated key file: no agent, no key search.
* The peer's authorized_keys binds that key to the receiver
  (``command="… -m drsvc.replication.receiver --pool POOL",restrict``); the verb
  we ask for reaches it as SSH_ORIGINAL_COMMAND.
* One authenticated connection per peer and process, shared by every sync
  (a process-wide cache keyed by host, port, user, key file and known_hosts,
  and by the two files' identity and mtime, so re-pinning a key or replacing
  the key file forces a fresh, fully checked login). A dead connection is
  replaced on the next open.
"""
from __future__ import annotations

import copy
import os
import shlex
import socket
import threading
import time
from pathlib import Path

import paramiko
import paramiko.packet

from ..errors import HostKeyMismatch, PeerAuthFailed, PeerUnreachable, PeerUntrusted
from . import Channel, Peer

# paramiko can stall ~30 s and drop the connection when it starts a rekey just
# as a channel closes (paramiko #822). With these limits out of reach, sshd
# (which rekeys correctly) leads every rekey.
paramiko.packet.Packetizer.REKEY_BYTES = 2 ** 40
paramiko.packet.Packetizer.REKEY_PACKETS = 2 ** 40


class _Transport(paramiko.Transport):
    """paramiko's transport, waking less often while idle. Its thread reads the socket with
    this timeout only to notice a close, and paramiko's own default (0.1 s) made every cached
    connection cost ten wake-ups a second while it waits for the next sync. Data and a close
    do not wait for it: a read returns as bytes arrive, and close() does not join the thread."""
    _active_check_timeout = 1.0


# AES-GCM is the fastest cipher paramiko has with AES-NI (CTR is markedly slower).
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "aes128-ctr", "aes256-ctr")
WINDOW_SIZE = 64 << 20
MAX_PACKET = 256 << 10
_RECV = 1 << 20


_LOCK = threading.Lock()
_CLIENTS: dict[tuple, paramiko.SSHClient] = {}
_LOGINS: dict[tuple, threading.Lock] = {}   # one login in flight per connection key
RTT_TTL = 60.0          # seconds a connection's measured round trip is trusted before a new probe


def _forget_after_fork() -> None:
    # a forked child must not share the parent's sockets and transport threads
    global _LOCK
    _LOCK = threading.Lock()
    _CLIENTS.clear()
    _LOGINS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _file_id(path: Path) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return (None,)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _alive(client: paramiko.SSHClient | None) -> bool:
    t = client.get_transport() if client is not None else None
    return t is not None and t.is_active()


def close_all() -> None:
    """Close every cached connection (tests; a worker at shutdown)."""
    with _LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    for c in clients:
        c.close()


def _no_delay(sock) -> None:
    """TCP_NODELAY: paramiko writes whole SSH packets, so Nagle only adds waits. Without it a
    small packet sent while the previous one is unacknowledged (a record after another,
    a commit after the last record) waits for the peer's delayed ACK, 40 ms on Linux."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass    # not a TCP socket (a proxy command, a unix socket)


class _RttProbe:
    """keepalive@openssh.com requests timed (sshd answers them, even with a failure); the least
    of SAMPLES, as the first one after a login can wait on sshd's own set-up (far longer than
    a round trip on a short path)."""

    SAMPLES = 3

    def __init__(self, t: paramiko.Transport):
        self.value: float | None = None
        self.at = time.monotonic()
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(t,), name="drsvc-rtt", daemon=True).start()

    def _run(self, t) -> None:
        try:
            for _ in range(self.SAMPLES):
                t0 = time.monotonic()
                t.global_request("keepalive@openssh.com", wait=True)
                took = time.monotonic() - t0
                self.value = took if self.value is None else min(self.value, took)
        except Exception:   # noqa: BLE001 - no measurement; the caller assumes none
            pass
        finally:
            self.at = time.monotonic()
            self.done.set()


class SshChannel(Channel):
    def __init__(self, chan: paramiko.Channel, name: str):
        self.chan, self.name = chan, name
        self.bytes_sent = 0

    def send(self, data) -> None:
        try:
            # paramiko's sendall slices what is left after each 32 KiB packet: on bytes that
            # copies the rest every time (16 MiB copied per 1 MiB record); a view slices free
            self.chan.sendall(memoryview(data))
        except (OSError, EOFError, paramiko.SSHException) as e:
            raise PeerUnreachable(peer=self.name, reason=f"connection lost while sending: {e}") from None
        self.bytes_sent += len(data)

    def recv(self, n: int) -> bytes:
        try:
            return self.chan.recv(min(n, _RECV))
        except TimeoutError:
            raise PeerUnreachable(peer=self.name, reason="no answer from the receiver in time") from None
        except (OSError, EOFError, paramiko.SSHException) as e:
            raise PeerUnreachable(peer=self.name, reason=f"connection lost: {e}") from None

    def close_write(self) -> None:
        try:
            self.chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def close(self) -> None:
        try:
            self.chan.close()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def exit_status(self, timeout: float = 5.0):
        if self.chan.status_event.wait(timeout):
            return self.chan.recv_exit_status()
        return None

    def buffered(self) -> bool:
        return self.chan.recv_ready() or self.chan.eof_received or self.chan.closed

    def alive(self) -> bool:
        t = self.chan.get_transport()
        return (not self.chan.closed and not self.chan.eof_received and not self.chan.exit_status_ready()
                and t is not None and t.is_active())


class SshPeer(Peer):
    def __init__(self, host: str, *, port: int = 22, user: str = "root", key_file, known_hosts,
                 name: str | None = None, connect_timeout: float = 15.0, io_timeout: float = 300.0,
                 ciphers=PREFERRED_CIPHERS):
        self.host, self.port, self.user = host, int(port), user
        self.key_file, self.known_hosts = Path(key_file), Path(known_hosts)
        self.name = name or (host if self.port == 22 else f"{host}:{self.port}")
        self.connect_timeout, self.io_timeout = connect_timeout, io_timeout
        self.ciphers = tuple(ciphers)
        self._client: paramiko.SSHClient | None = None
        self.connects = 0     # logins this Peer made (0 when it found one cached)
        self.lane_no = 0      # which of the peer's cached connections (striping spreads over several)

    @property
    def session_key(self) -> tuple:
        """Identity of the connection: what it was authenticated and pinned with, and its lane."""
        return (self.host, self.port, self.user, str(self.key_file), _file_id(self.key_file),
                str(self.known_hosts), _file_id(self.known_hosts), self.ciphers, self.lane_no)

    def lane(self, i: int) -> SshPeer:
        """The same peer over its i-th connection: a login of its own, cached and checked like
        the first (a single TCP connection may be capped by the kernel's buffers on a real path)."""
        if i == self.lane_no:
            return self
        other = copy.copy(self)
        other._client, other.connects, other.lane_no = None, 0, i
        return other

    def rtt(self, wait: float = 0.0) -> float | None:
        """The connection's round trip, measured by a keepalive request (one RTT) on a thread
        of its own, once per RTT_TTL; never on the caller's path unless it waits."""
        client = self._client
        if client is None:          # a Peer built for this sync, on a login cached by an earlier one
            with _LOCK:
                client = _CLIENTS.get(self.session_key)
        t = client.get_transport() if client is not None else None
        if t is None or not t.is_active():
            return None
        probe = getattr(t, "_drsvc_rtt", None)
        if probe is not None and probe.done.is_set() and time.monotonic() - probe.at > RTT_TTL:
            t._drsvc_rtt = _RttProbe(t)        # a fresh one in the background; this call keeps the last
        elif probe is None:
            probe = t._drsvc_rtt = _RttProbe(t)
        probe.done.wait(wait)
        return probe.value

    def _transport_factory(self, sock, **kwargs):
        _no_delay(sock)
        t = _Transport(sock, **kwargs)
        opts = t.get_security_options()
        supported = set(opts.ciphers)
        preferred = [c for c in self.ciphers if c in supported]
        opts.ciphers = tuple(preferred + [c for c in opts.ciphers if c not in preferred])
        return t

    def connect(self) -> paramiko.SSHClient:
        """The cached connection, or a new login. Logins are one-flight per key: stripes that
        share a lane and ask at once wait for one login instead of racing to make several."""
        key = self.session_key
        with _LOCK:
            login = _LOGINS.setdefault(key, threading.Lock())
        with login:
            with _LOCK:
                cached = _CLIENTS.get(key)
                if _alive(cached):
                    self._client = cached
                    return cached
                _CLIENTS.pop(key, None)
            if cached is not None:
                cached.close()
            client = self._login()
            with _LOCK:
                _CLIENTS[key] = client
        self._client = client
        self.rtt()            # a first measurement, in the background, while the caller goes on
        return client

    def drop(self) -> None:
        """Forget and close the cached connection (it failed under us)."""
        key = self.session_key
        with _LOCK:
            client = _CLIENTS.get(key)
            if client is not None and client is self._client:
                del _CLIENTS[key]
            else:
                client = None
        self._client = None
        if client is not None:
            client.close()

    def _login(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        try:
            client.load_host_keys(str(self.known_hosts))
        except (OSError, paramiko.SSHException) as e:
            raise PeerUntrusted(peer=self.name, reason=f"cannot read {self.known_hosts}: {e}") from None
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            pkey = paramiko.PKey.from_path(str(self.key_file))
        except (OSError, paramiko.SSHException, ValueError) as e:
            raise PeerAuthFailed(peer=self.name, reason=f"cannot load key {self.key_file}: {e}") from None
        try:
            client.connect(self.host, port=self.port, username=self.user, pkey=pkey,
                           allow_agent=False, look_for_keys=False, timeout=self.connect_timeout,
                           banner_timeout=self.connect_timeout, auth_timeout=self.connect_timeout,
                           transport_factory=self._transport_factory)
        except paramiko.BadHostKeyException:
            client.close()
            raise HostKeyMismatch(peer=self.name, known_hosts=str(self.known_hosts)) from None
        except paramiko.AuthenticationException as e:
            client.close()
            raise PeerAuthFailed(peer=self.name, reason=str(e) or type(e).__name__) from None
        except paramiko.SSHException as e:
            client.close()
            if "known_hosts" in str(e):   # RejectPolicy: host not in the pinned file
                raise PeerUntrusted(peer=self.name, reason=f"no key pinned in {self.known_hosts}") from None
            raise PeerUnreachable(peer=self.name, reason=str(e)) from None
        except (OSError, EOFError) as e:
            client.close()
            raise PeerUnreachable(peer=self.name, reason=str(e) or type(e).__name__) from None
        self.connects += 1
        return client

    @property
    def cipher(self) -> str | None:
        t = self._client.get_transport() if self._client else None
        return t.remote_cipher if t else None

    def open(self, verb: str, *args: str) -> SshChannel:
        for attempt in (0, 1):
            fresh = self.connects
            t = self.connect().get_transport()
            try:
                chan = t.open_session(window_size=WINDOW_SIZE, max_packet_size=MAX_PACKET,
                                      timeout=self.connect_timeout)
                chan.settimeout(self.io_timeout)
                chan.exec_command(shlex.join([verb, *args]))
                return SshChannel(chan, self.name)
            except (OSError, EOFError, paramiko.SSHException) as e:
                self.drop()
                if attempt or self.connects > fresh:   # a fresh login failed too
                    raise PeerUnreachable(peer=self.name, reason=f"cannot open a channel: {e}") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Let go of the connection; it stays cached for the next sync of this process."""
        self._client = None
