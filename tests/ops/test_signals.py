"""A long-running process stops on SIGTERM whichever of its threads the kernel hands the
signal to (drsvc.signals). The node plugin once slept through its SIGTERM under load: a
gRPC thread took the signal, and the main thread's untimed Event.wait() never looked again
(tests/multinode/test_controller.py, plugin.wait() timed out)."""
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from drsvc_lab import wait_until

# the main thread blocks SIGTERM, so the kernel must give it to the other thread, as it
# may give it to any of the plugin's gRPC threads
CHILD = textwrap.dedent("""
    import signal, sys, threading, time
    from drsvc.signals import StopSignals
    {wait}
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    print("ready", flush=True)
    sys.exit(100 + wait())
""")


FUTEX = 202      # x86_64: where a thread blocked on a lock (Event.wait) sits


def _blocked(pid: int) -> bool:
    """The child's main thread sits in futex(2): it is inside its wait, past the last
    bytecode that would run a pending Python handler."""
    try:
        return Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()[0] == str(FUTEX)
    except (OSError, IndexError):
        return False


def _run(wait: str, timeout: float = 10) -> int | None:
    p = subprocess.Popen([sys.executable, "-c", CHILD.format(wait=wait)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        # a signal that comes before the main thread blocks is handled at its next bytecode,
        # and even an untimed wait then returns: signal once it waits (a loaded machine is slow
        # to get there)
        wait_until(lambda: _blocked(p.pid), 30, "the child's main thread to block in its wait", interval=0.01)
        p.send_signal(signal.SIGTERM)
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        p.kill()
        p.wait()


def test_a_signal_taken_by_another_thread_stops_the_process():
    assert _run("wait = StopSignals().wait") == 100 + signal.SIGTERM


def test_an_untimed_event_wait_sleeps_through_it():
    """The trap itself, so the test above is known to reproduce it."""
    wait = ("stop = threading.Event()\n"
            "signal.signal(signal.SIGTERM, lambda *_: stop.set())\n"
            "def wait():\n"
            "    stop.wait()\n"
            "    return 0")
    if _run(wait, timeout=3) is not None:
        pytest.fail("an untimed Event.wait() woke on a signal another thread took: the trap is gone here")
