"""`drsvc demo`: the lab's showcase, two sites on this machine and a database-like workload.

- ``run``: the demo itself (``run_demo``, ``demo_down``): builds a lab of two sites, runs the
  workload, syncs, fails over and back, and prints what it measured beside rsync;
- ``view``: how it prints (rich tables on a terminal or a pipe, or JSON);
- ``workload``: the write pattern (database-like files) and rsync's cost for the same change.

The operator's CLI (``drsvc_cli``) only dispatches ``drsvc demo`` here, on first use.
"""
