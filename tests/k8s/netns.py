"""Network namespaces of the two sites: each site's loopback is its own (its etcd,
apiserver, Redis and sidecars on 127.0.0.1 are seen by that site alone), and a veth pair
joins them so the sites' SSH replication crosses from one namespace to the other as it
crosses a network between two clusters."""
from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass

from drsvc import runner

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclass
class Netns:
    name: str
    addr: str        # this site's end of the veth pair, where its sshd listens

    @property
    def exec_argv(self) -> list[str]:
        """Prefix of an argv run inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    @contextlib.contextmanager
    def entered(self):
        """The calling thread in the namespace for the block: the processes it starts
        (through drsvc.runner, as drsvc_lab starts a site's) and the sockets it opens live
        there. The thread's own namespace is restored on the way out."""
        here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
        try:
            _setns(there)
            try:
                yield self
            finally:
                _setns(here)
        finally:
            os.close(here)
            os.close(there)


def _ip(*args) -> None:
    runner.run(["ip", *args], timeout=30)


def create_pair(prefix: str, names=("a", "b"), subnet: str = "10.245.45") -> dict[str, Netns]:
    """Two namespaces, {name}-{site}, lo up in each, joined by a veth pair with
    {subnet}.1 and {subnet}.2."""
    spaces = {}
    for i, site in enumerate(names, start=1):
        ns = Netns(f"{prefix}-{site}", f"{subnet}.{i}")
        _ip("netns", "add", ns.name)
        spaces[site] = ns
    ends = [f"{prefix[-10:]}{s}" for s in names]
    _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
    for end, ns in zip(ends, spaces.values(), strict=True):
        _ip("link", "set", end, "netns", ns.name)
        _ip("-n", ns.name, "addr", "add", f"{ns.addr}/24", "dev", end)
        _ip("-n", ns.name, "link", "set", end, "up")
        _ip("-n", ns.name, "link", "set", "lo", "up")
    return spaces


def delete(spaces: dict[str, Netns]) -> None:
    """Remove the namespaces (the veth pair goes with them)."""
    for ns in spaces.values():
        runner.run(["ip", "netns", "delete", ns.name], timeout=30, check=False)
