"""A room's public names, imported on first use.

Each room's ``__init__`` lists the names outside code may use (``{name: "submodule"}``,
or ``"submodule:attribute"`` where the public name differs) and takes its module
``__getattr__`` from :func:`lazy_exports`: importing a room loads none of its modules, so
``python -m drsvc.replication.receiver`` starts without the sender and the plugin without
the receiver.
"""
from __future__ import annotations

from importlib import import_module


def lazy_exports(package: str, table: dict[str, str]):
    def __getattr__(name: str):
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = where.partition(":")
        return getattr(import_module(f"{package}.{module}"), attr or name)
    return __getattr__
