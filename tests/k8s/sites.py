"""The drsvc lab of the ordinary tests (drsvc_lab.Lab), each site's processes inside its
site's network namespace: its Redis on the namespace's loopback, its sshd on its end of
the veth pair, and its peer reached there, so a sync really crosses from one cluster's
network to the other's. Each site requires the RPC token of its secrets_file, as both
shipped overlays do (and the classes hand the sidecar that Secret)."""
from __future__ import annotations

import secrets

from drsvc_lab import Lab
from drsvc_lab.sshd import start_sshd

from .netns import Netns


class NetLab(Lab):
    def __init__(self, root, spaces: dict[str, Netns], **kw):
        super().__init__(root, names=tuple(spaces), **kw)
        self.spaces = spaces
        self.tokens = {n: secrets.token_hex(16) for n in spaces}

    def _spawn_redis(self, s) -> None:
        with self.spaces[s.name].entered():
            super()._spawn_redis(s)

    def _start_sshd(self, s) -> None:
        ns = self.spaces[s.name]
        s.sshd_port = s.sshd_port or 2222
        with ns.entered():
            p = start_sshd(s.ssh, ns.addr, s.sshd_port, self._authorized(s))
        s.sshd_pid = p.pid
        s.procs.append(p)

    def _write_config(self, s) -> None:
        """The lab's config, its peer at the peer's veth address (pinned host key for that
        address), and the token file the site requires."""
        super()._write_config(s)
        token = s.root / "rpc-token"
        token.write_text(self.tokens[s.name] + "\n")
        text = s.config_path.read_text()
        for peer in self.sites.values():
            if peer.name == s.name:
                continue
            addr = self.spaces[peer.name].addr
            text = text.replace(f'[peers.{peer.name}]\nhost = "127.0.0.1"', f'[peers.{peer.name}]\nhost = "{addr}"')
            kh = s.ssh / f"{peer.name}.known_hosts"
            kh.write_text(kh.read_text().replace("[127.0.0.1]:", f"[{addr}]:"))
        text = text.replace("\n\n[peers.", f'\nsecrets_file = "{token}"\n\n[peers.', 1)
        s.config_path.write_text(text)

    def up(self, *names, components=("plugin", "worker", "control", "scheduler")) -> None:
        for n in names or self.sites:
            with self.spaces[n].entered():
                self.sites[n].run.up(components)
