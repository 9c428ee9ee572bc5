"""Test tiers: `pytest -m fast` runs the tests that need no root and no lab (the planner,
block maps, protocol framing, config, errors, layouts, grids): seconds in all. tests/tiers.py
keeps the tier honest."""
pytest_plugins = ["pytester", "tests.tiers", "tests.fixtures.xfs", "tests.fixtures.sites", "tests.fixtures.sshd",
                  "tests.fixtures.csi", "tests.faults.tally"]
