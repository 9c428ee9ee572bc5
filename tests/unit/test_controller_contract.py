"""The controller contract is written once (drsvc.controller_api) and every implementation is
held to it here, as csi-driver-host-path holds its driver to one ``State`` interface at
compile time (``var _ State = &state{}`` in pkg/state/state.go): each member exists on each
implementation with the same parameters, kinds, defaults and types; every node operation
(NodeOps.op_*) is a contract operation, with the contract's parameters, or a named
node-only one."""
from __future__ import annotations

import inspect
import typing
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Protocol

import pytest

from drsvc.cluster import NODE_ONLY_OPS, NODE_OPS, ClusterController, ClusterReplication, NodeOps
from drsvc.controller import PoolController
from drsvc.controller_api import CONTROLLER_OPS, REPLICATION_OPS, Controller, ReplicationControl, operations
from drsvc.errors import DrsvcError
from drsvc.replication.control.api import ReplicationAPI

pytestmark = pytest.mark.fast


def _hints(fn) -> dict:
    return typing.get_type_hints(fn)


def _params(fn) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())[1:]        # without self


def _signature_mismatches(where: str, want, got) -> list[str]:
    """Where *got* (an implementation's method) differs from *want* (the contract's)."""
    out = []
    wp, gp = _params(want), _params(got)
    shape = [(p.name, p.kind, p.default) for p in wp]
    if shape != [(p.name, p.kind, p.default) for p in gp]:
        out.append(f"{where}: parameters {[(p.name, p.kind.name, p.default) for p in gp]}, "
                   f"the contract's {[(p.name, p.kind.name, p.default) for p in wp]}")
    wh, gh = _hints(want), _hints(got)
    for name, hint in wh.items():
        if gh.get(name) != hint:
            out.append(f"{where}: {name} is {gh.get(name, 'not annotated')}, the contract's {hint}")
    return out


def mismatches(impl: type, contract: type) -> list[str]:
    """Every way *impl* does not implement *contract* (empty: it does)."""
    out = []
    for name, member in vars(contract).items():
        if name.startswith("_"):
            continue
        got = inspect.getattr_static(impl, name, None)
        where = f"{impl.__name__}.{name}"
        if isinstance(member, property):
            if not isinstance(got, property):
                out.append(f"{where}: not a property")
            elif _hints(got.fget).get("return") != _hints(member.fget).get("return"):
                out.append(f"{where}: returns {_hints(got.fget).get('return')}")
        elif inspect.isfunction(member):
            if not inspect.isfunction(got):
                out.append(f"{where}: missing")
            else:
                out += _signature_mismatches(where, member, got)
    return out


@pytest.mark.parametrize("impl", [PoolController, ClusterController])
def test_both_controllers_implement_the_controller_contract(impl):
    assert CONTROLLER_OPS, "the contract lists no operation"
    assert mismatches(impl, Controller) == []


@pytest.mark.parametrize("impl", [ReplicationAPI, ClusterReplication])
def test_both_replication_apis_implement_the_replication_contract(impl):
    assert REPLICATION_OPS == ("enable", "disable", "promote", "demote", "resync", "info", "sync_now")
    assert mismatches(impl, ReplicationControl) == []


def test_node_ops_are_the_contract_ops_and_the_named_node_only_ops():
    ops = {name[3:] for name, m in vars(NodeOps).items() if name.startswith("op_") and inspect.isfunction(m)}
    assert not NODE_ONLY_OPS & set(CONTROLLER_OPS)
    assert ops - NODE_OPS == set(), "node operations that are neither contract nor named node-only ops"
    assert NODE_OPS - ops == set(), "contract or node-only operations with no op_ method"


@pytest.mark.parametrize("op", CONTROLLER_OPS)
def test_each_node_op_takes_the_contract_parameters(op):
    """The controller sends a contract call's arguments by name: the node op must take every
    one of them, keep the contract's defaults (the controller may leave an argument out),
    and anything more it takes must be optional."""
    want = {p.name: p for p in _params(getattr(Controller, op))}
    got = {p.name: p for p in _params(getattr(NodeOps, f"op_{op}"))}
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in got.values())
    assert set(want) <= set(got), f"op_{op} lacks {set(want) - set(got)}"
    for name, p in want.items():
        if p.default is not p.empty:
            assert got[name].default == p.default, f"op_{op}({name}=…) has another default"
    extra = [n for n in set(got) - set(want) if got[n].default is got[n].empty]
    assert not extra, f"op_{op} requires {extra}, which the contract does not send"


def test_node_calls_that_expire_are_node_ops():
    from workers.client import EXPIRING_NODE_OPS
    assert EXPIRING_NODE_OPS <= NODE_OPS


def test_a_node_op_not_declared_is_refused():
    class Rogue(NodeOps):
        def op_rogue(self):
            return "ran"
    ops = Rogue(SimpleNamespace(site=SimpleNamespace(volumes=None)))
    with pytest.raises(DrsvcError, match="unknown node operation 'rogue'"):
        ops.run("rogue", {})


class _Small(Protocol):
    @property
    def name(self) -> str: ...

    def get(self, ident: str, *, limit: int = 0, names: Sequence[str] = ()) -> dict: ...

    def put(self, ident: str) -> None: ...


def test_the_check_finds_each_kind_of_mismatch():
    """The check above can fail: a missing method, a renamed or re-kinded parameter, another
    default, another type and a plain attribute for a property are each reported."""
    class Good:
        @property
        def name(self) -> str:
            return ""

        def get(self, ident: str, *, limit: int = 0, names: Sequence[str] = ()) -> dict:
            return {}

        def put(self, ident: str) -> None:
            pass

    class Bad:
        name = "x"

        def get(self, ident: str, limit: int = 1, names: list[str] = ()) -> dict:
            return {}

        def pub(self, ident: str) -> None:
            pass

    assert mismatches(Good, _Small) == []
    found = "\n".join(mismatches(Bad, _Small))
    assert "Bad.name: not a property" in found
    assert "Bad.get: parameters" in found and "KEYWORD_ONLY" in found
    assert "Bad.get: names is list[str]" in found
    assert "Bad.put: missing" in found
    assert operations(_Small) == ("get", "put")
