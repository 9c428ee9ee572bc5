"""The C library, for the few calls the os module lacks (fallocate's hole punching,
sync_file_range). Opened by its soname first: ``ctypes.util.find_library`` runs ldconfig in
a subprocess, which a receiver (one process per channel) should not pay for."""
from __future__ import annotations

import ctypes

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    """The process's C library, opened once (errno kept for ``ctypes.get_errno``)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            from ctypes.util import find_library
            _libc = ctypes.CDLL(find_library("c"), use_errno=True)
    return _libc
