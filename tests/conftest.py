pytest_plugins = ["tests.fixtures.xfs"]
