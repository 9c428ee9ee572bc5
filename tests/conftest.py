"""Test tiers: `pytest -m fast` runs the tests that need no root and no lab (the planner,
block maps, protocol framing, config, errors, layouts, grids): seconds in all. tests/tiers.py
keeps the tier honest."""
import os

import pytest

pytest_plugins = ["pytester", "tests.tiers", "tests.fixtures.xfs", "tests.fixtures.sites", "tests.fixtures.sshd",
                  "tests.fixtures.csi", "tests.faults.tally"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (--dist loadgroup): a module's tests stay on one worker, so its
    shared lab or plugin is built once, and run in order. The fault suite's modules share
    their worker's one lab (a session fixture), healed after each test.

    First among the hooks: xdist's own (xdist/remote.py) reads the xdist_group marks into
    the node ids as it collects, and a mark added after it groups nothing."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        module = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(module))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A `serial` test measures shares of a rate on this machine, alone: what ran before it
    (the parallel stage's images, gigabytes of them) is written back first, with sync(2),
    rather than by the kernel's flusher threads while it measures."""
    if item.get_closest_marker("serial") is not None:
        os.sync()
