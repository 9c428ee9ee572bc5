"""Pure rules of the consumers' calls: the peer a class names, and the seed's codes."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from csi_plugin.addons_servicers import SEED_CODES, seed_codes
from drsvc.config import parse
from drsvc.errors import InternalError, InvalidParameter, OperationInProgress, PeerUnreachable, PreconditionFailed
from drsvc.replication.control.enablement import resolve_peer

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so


def _cfg(site, peers):
    return parse({"site": site, "pool": "/tmp/p", "peers": {
        p: {"host": "h", "known_hosts": "k", "key": "k"} for p in peers}}, Path("/tmp/site.toml"))


def test_peer_names_either_site_of_the_pair():
    a = _cfg("a", ["b"])
    assert resolve_peer(a, "b") == "b"
    assert resolve_peer(a, "a") == "b"          # the same class at both clusters names one of them
    assert resolve_peer(a, "") == "b"
    with pytest.raises(InvalidParameter):
        resolve_peer(a, "c")
    many = _cfg("a", ["b", "c"])
    assert resolve_peer(many, "c") == "c"
    with pytest.raises(InvalidParameter):
        resolve_peer(many, "")
    with pytest.raises(InvalidParameter):
        resolve_peer(many, "a")


class _Aborted(Exception):
    pass


class _Context:
    """The part of grpc.ServicerContext the decorator uses."""
    def __init__(self):
        self.code = None

    def abort(self, code, details):
        self.code = code
        raise _Aborted(details)


class _Servicer:
    def __init__(self, exc):
        self.exc = exc

    @seed_codes
    def EnableVolumeReplication(self, req, context):
        raise self.exc

    @seed_codes
    def PromoteVolume(self, req, context):
        raise self.exc


@pytest.mark.parametrize("exc,method,passes", [
    (PreconditionFailed("x"), "EnableVolumeReplication", False),   # not in Enable's table
    (PreconditionFailed("x"), "PromoteVolume", True),
    (OperationInProgress(key="u"), "EnableVolumeReplication", True),
    (InternalError("boom"), "PromoteVolume", False),   # INTERNAL -> UNKNOWN
    (PeerUnreachable(peer="b", reason="r"), "PromoteVolume", False),     # UNAVAILABLE -> UNKNOWN
])
def test_codes_outside_the_seed_table_are_unknown(exc, method, passes):
    ctx = _Context()
    call = getattr(_Servicer(exc), method)
    if passes:
        with pytest.raises(type(exc)):
            call(None, ctx)
        assert ctx.code is None
    else:
        with pytest.raises(_Aborted):
            call(None, ctx)
        assert ctx.code == grpc.StatusCode.UNKNOWN
    assert grpc.StatusCode.INTERNAL not in SEED_CODES[method]
