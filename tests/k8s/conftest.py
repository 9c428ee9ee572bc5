"""The k8s suite's fixtures: one World (two clusters over a two-site drsvc lab) for the
session, and after each test a check that every process still runs and that no sidecar
was refused by the manifests' RBAC: no 403 in the apiserver's audit log for the drsvc
namespace's ServiceAccounts, no refusal in the sidecars' logs (a permission missing from
deploy/ fails the test that needed it, even where the sidecar carries on: with `update` on
volumesnapshots dropped again, the snapshot test errors on the provisioner's 403)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from . import bins, world

HERE = Path(__file__).parent
FORBIDDEN = re.compile(r"forbidden|cannot (get|list|watch|create|update|patch|delete) resource", re.I)


# the modules' order: the install first, the forced failover (which takes site a down) last
ORDER = ("test_install.py", "test_planned.py", "test_group.py", "test_snapshot.py", "test_forced.py")


def pytest_collection_modifyitems(config, items):
    """This directory's tests in ORDER, in the places they hold among the session's."""
    slots = [i for i, item in enumerate(items) if item.path.parent == HERE and item.path.name in ORDER]
    ours = sorted((items[i] for i in slots), key=lambda item: ORDER.index(item.path.name))  # stable
    for i, item in zip(slots, ours, strict=True):
        items[i] = item


def pytest_report_header(config):
    d = os.environ.get(bins.ENV)
    if not d:
        return f"k8s: {bins.ENV} is not set"
    try:
        found = bins.versions(bins.bin_dir())
    except Exception as e:  # noqa: BLE001 - a header; the tests say what is wrong
        return f"k8s: {e}"
    return "k8s: " + ", ".join(f"{n} {v}" for n, v in found.items())


@pytest.fixture(scope="session")
def bin_dir():
    try:
        return bins.bin_dir()
    except bins.MissingBinaries as e:
        missing = str(e)
    pytest.fail(missing, pytrace=False)


@pytest.fixture(scope="session")
def k8s_world(bin_dir):
    w = world.build(bin_dir)
    try:
        yield w
    finally:
        w.teardown()


@pytest.fixture(scope="session")
def timings(request):
    """{what: seconds} measured by the tests, printed at the end of the run."""
    t = request.config.stash.setdefault(TIMINGS, {})
    return t


TIMINGS = pytest.StashKey[dict]()


def pytest_terminal_summary(terminalreporter, config):
    t = config.stash.get(TIMINGS, None)
    if t:
        terminalreporter.section("k8s timings")
        for what, secs in t.items():
            terminalreporter.write_line(f"{what}: {secs:.2f}s" if isinstance(secs, float) else f"{what}: {secs}")


def refusals(w) -> list[str]:
    """Lines of the sidecars' logs where the apiserver refused them."""
    out = []
    for s in w.sites.values():
        for name in s.sidecars:
            log = s.cluster.log(name)
            if log.exists():
                out += [f"{s.name}/{name}: {line.strip()[:300]}" for line in log.read_text(errors="replace").splitlines()
                        if FORBIDDEN.search(line)]
    return out


@pytest.fixture
def sites(k8s_world):
    """{name: K8sSite}; after the test: every sidecar of a running site still runs, and no
    sidecar was refused by RBAC."""
    yield k8s_world.sites
    for s in k8s_world.sites.values():
        if s.cluster.alive("kube-apiserver"):
            s.cluster.check_alive(*s.sidecars)
    refused = refusals(k8s_world) + [d for s in k8s_world.sites.values() for d in s.cluster.denials()]
    assert not refused, "requests the manifests' RBAC refused:\n" + "\n".join(refused)
