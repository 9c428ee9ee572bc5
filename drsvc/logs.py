"""Module loggers that load ``logging`` when they first log.

The receiver starts once per channel, and most of its runs log nothing: ``logging`` (with
``traceback``, ``linecache`` and ``tokenize`` behind it) is about a tenth of what such a run
imports. A module on the receiver's path takes ``log = logger(__name__)`` instead of
``logging.getLogger(__name__)``; the first call made on it imports logging and hands on to the
real logger, so handlers, levels and names are exactly logging's."""
from __future__ import annotations


class LazyLogger:
    __slots__ = ("name", "_real")

    def __init__(self, name: str):
        self.name = name
        self._real = None

    def __getattr__(self, attr: str):
        real = self._real
        if real is None:
            import logging
            real = self._real = logging.getLogger(self.name)
        return getattr(real, attr)


def logger(name: str) -> LazyLogger:
    return LazyLogger(name)
