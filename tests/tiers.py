"""The fast tier's guard, a pytest plugin (tests/conftest.py loads it).

`pytest -m fast` runs the tests that need no root and no lab. A test marked `fast` that
asks for a lab or root fixture fails at setup; one that starts any process while it
sets up or runs fails there (an audit hook), so the tier stays what it says.
"""
import os
import sys

import pytest

# fixtures that need root (loop devices, mounts) or start lab processes (redis, sshd, sites)
LAB_FIXTURES = frozenset({
    "lab", "shared_lab", "module_lab", "fault_lab", "flab", "fuzz_lab", "xfs_dir", "xfs_mod", "make_plugin", "plugin",
    "module_fs", "module_plugin",
    "md_plugin", "sshd_factory", "redis_port", "r", "site_n1", "nodes", "two", "lab3", "password_lab",
    "small_peer_lab", "pools", "span", "site", "fsroot", "dispatcher", "ansible"})
_PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                             "os.fork", "os.forkpty"})
# ctypes.util.find_library's probes (libc for fallocate, FIEMAP, ...): no lab in them
_LIBRARY_PROBES = frozenset({"ldconfig", "gcc", "cc", "ld", "objdump"})
_fast_now: list = []          # the fast test being set up or run


def _no_process_in_fast_tests(event: str, args) -> None:
    if _fast_now and event in _PROCESS_EVENTS and not _library_probe(event, args):
        raise RuntimeError(f"{_fast_now[0]} is marked fast but starts a process ({event}: {args!r:.200}); "
                           "a fast test needs no root, no lab and no process")


def _library_probe(event: str, args) -> bool:
    return event == "subprocess.Popen" and os.path.basename(str(args[0] or args[1][0])) in _LIBRARY_PROBES


sys.addaudithook(_no_process_in_fast_tests)


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: no root, no lab; runs in seconds (pytest -m fast)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    fast = item.get_closest_marker("fast") is not None
    if fast and (lab := sorted(LAB_FIXTURES & set(item.fixturenames))):
        pytest.fail(f"{item.nodeid} is marked fast but uses {', '.join(lab)}: a fast test needs no root "
                    "and no lab", pytrace=False)
    yield from _as_fast(item, fast)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _as_fast(item, item.get_closest_marker("fast") is not None)


def _as_fast(item, fast: bool):
    # teardown stays out: a lab shared by the session may be torn down after a fast test
    if fast:
        _fast_now.append(item.nodeid)
    try:
        yield
    finally:
        if fast:
            _fast_now.clear()

