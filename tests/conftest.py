"""Test tiers: `pytest -m fast` runs the tests that need no root and no lab (the planner,
block maps, protocol framing, config, errors, layouts, grids): seconds in all. tests/tiers.py
keeps the tier honest."""
import json
import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester", "tests.tiers", "tests.fixtures.xfs", "tests.fixtures.sites", "tests.fixtures.sshd",
                  "tests.fixtures.csi", "tests.faults.tally"]


DURATIONS = Path(__file__).with_name("durations.json")


def module_seconds() -> dict:
    """{module path: seconds} of the last measured run (``scripts/test-durations``)."""
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (--dist loadgroup): a module's tests stay on one worker, so its
    shared lab or plugin is built once, and run in order. The fault suite's modules share
    their worker's one lab (a session fixture), healed after each test.

    First among the hooks: xdist's own (xdist/remote.py) reads the xdist_group marks into
    the node ids as it collects, and a mark added after it groups nothing.

    The modules go out longest first (``tests/durations.json``: each module's seconds in a
    measured run; a module not listed goes last), so the long fault and playbook modules do
    not start at the end and hold the run while the other workers idle (xdist's own order,
    by number of tests, is turned off in pyproject.toml: ``--no-loadscope-reorder``)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if hasattr(config, "workerinput"):      # an xdist worker: its collection is the order handed out
        weights = module_seconds()
        items.sort(key=lambda item: -weights.get(item.nodeid.split("::")[0], 0.0))  # stable: a module keeps its order
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
