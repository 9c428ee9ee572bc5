"""One two-site lab shared by the fault suite (building one costs ~12 s), healed after
every test: sshds up, every component running, receivers without failpoints, site
configs as built. Each test works on volumes of its own."""
from __future__ import annotations

import re

import pytest

from drsvc_lab import Lab
from tests.fixtures.sites import build_lab as build_site_lab
from tests.fixtures.sites import close_lab, heal

__all__ = ["build_lab", "close_lab", "heal"]

# short, so a task of a SIGKILLed worker comes back within seconds; every sync
# the suite stretches stays well below it
VISIBILITY_TIMEOUT = 8
# every sync of the suite is striped (protocol 4): a master channel and 3 stripe channels over
# 2 SSH connections, whatever its size, so every fault lands on a striped transaction
STRIPES = 'stripes = 4\nconnections = 2\n'


def build_lab(prefix: str, **kw) -> Lab:
    return build_site_lab(prefix, visibility_timeout=VISIBILITY_TIMEOUT, configure=_striped, **kw)


def _striped(text: str) -> str:
    """Every peer of the suite's sites stripes every sync (STRIPES)."""
    return re.sub(r"(\[peers\.[^\]\n]+\]\n)", lambda m: m.group(1) + STRIPES, text)


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


