"""One two-site lab shared by the fault suite (building one costs ~12 s), healed after
every test: sshds up, every component running, receivers without failpoints, site
configs as built. Each test works on volumes of its own."""
from __future__ import annotations

import pytest

from drsvc_lab import Lab
from tests.fixtures.sites import build_lab as build_site_lab
from tests.fixtures.sites import close_lab, heal

__all__ = ["build_lab", "close_lab", "heal"]

# short, so a task of a SIGKILLed worker comes back within seconds; every sync
# the suite stretches stays well below it
VISIBILITY_TIMEOUT = 8


def build_lab(prefix: str, **kw) -> Lab:
    return build_site_lab(prefix, visibility_timeout=VISIBILITY_TIMEOUT, **kw)


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


