"""One two-site lab shared by the fault suite (building one costs ~12 s), healed after
every test: sshds up, every component running, receivers without failpoints, site
configs as built. Each test works on volumes of its own."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from drsvc.lab import Lab
from tests.fixtures.sites import Client, need_lab

from .steps import set_receiver_failpoints

# short, so a task of a SIGKILLed worker comes back within seconds; every sync
# the suite stretches stays well below it
VISIBILITY_TIMEOUT = 8
# every sync of the suite is striped (protocol 4): a master channel and 3 stripe channels over
# 2 SSH connections, whatever its size, so every fault lands on a striped transaction
STRIPES = 'stripes = 4\nconnections = 2\n'


def build_lab(prefix: str, **kw) -> Lab:
    need_lab()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    lab = Lab(root, visibility_timeout=VISIBILITY_TIMEOUT, **kw).build()
    for s in lab.sites.values():
        text = s.config_path.read_text()
        s.config_path.write_text(re.sub(r"(\[peers\.[^\]\n]+\]\n)", lambda m: m.group(1) + STRIPES, text))
    lab.configs = {n: s.config_path.read_text() for n, s in lab.sites.items()}
    lab.known_hosts = {n: {p: (s.root / "ssh" / f"{p}.known_hosts").read_text() for p in lab.sites if p != n}
                       for n, s in lab.sites.items()}
    lab.up()
    lab.clients = {n: Client(s) for n, s in lab.sites.items()}
    return lab


def close_lab(lab: Lab) -> None:
    for c in lab.clients.values():
        c.close()
    lab.teardown()


def heal(lab: Lab) -> None:
    """Undo whatever a test broke, so the next one starts from a working lab."""
    changed = False
    for n, s in lab.sites.items():
        set_receiver_failpoints(lab, n, ())
        if s.config_path.read_text() != lab.configs[n]:
            s.config_path.write_text(lab.configs[n])
            changed = True
        for p, text in lab.known_hosts[n].items():
            (s.root / "ssh" / f"{p}.known_hosts").write_text(text)
        if not s.sshd_pid:
            lab.start_sshd(n)
    for s in lab.sites.values():
        if changed:
            s.run.stop("worker")
        s.run.up()


@pytest.fixture(scope="session")
def fault_lab():
    lab = build_lab("drsvc-faults-")
    try:
        yield lab
    finally:
        close_lab(lab)


@pytest.fixture
def flab(fault_lab):
    try:
        yield fault_lab
    finally:
        heal(fault_lab)


@pytest.fixture
def rnd(request):
    """A seeded RNG per test; the seed is printed so a failing run can be replayed."""
    import os
    import random
    seed = int(os.environ.get("FAULT_SEED") or random.randrange(1 << 30))
    print(f"{request.node.name}: FAULT_SEED={seed}")
    return random.Random(seed)


