pytest_plugins = ["tests.fixtures.xfs", "tests.fixtures.sites", "tests.fixtures.sshd", "tests.fixtures.csi",
                  "tests.faults.tally"]
