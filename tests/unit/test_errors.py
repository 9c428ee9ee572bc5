"""Every domain error maps to a gRPC code through its category, to a CLI exit code, and
survives the worker -> plugin round trip with its class (drsvc.dispatch)."""
import inspect

import grpc
import pytest

from csi_plugin.errors import CODE_TABLE, code_for
from drsvc import errors as E
from drsvc.dispatch import error_to_dict, raise_from_dict
from drsvc_cli.main import EXIT_BY_CODE, EXIT_FAIL

CATEGORIES = {E.InvalidInput: grpc.StatusCode.INVALID_ARGUMENT, E.NotFound: grpc.StatusCode.NOT_FOUND,
              E.Conflict: grpc.StatusCode.ALREADY_EXISTS, E.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
              E.PreconditionFailed: grpc.StatusCode.FAILED_PRECONDITION,
              E.OperationInProgress: grpc.StatusCode.ABORTED,
              E.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
              E.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED, E.Unavailable: grpc.StatusCode.UNAVAILABLE,
              E.Unsupported: grpc.StatusCode.UNIMPLEMENTED, E.InternalError: grpc.StatusCode.INTERNAL}
# conditions the table names on their own, ahead of the categories
SPECIAL = {E.BadPageToken: grpc.StatusCode.ABORTED}
ALL = sorted((c for _, c in inspect.getmembers(E, inspect.isclass)
              if issubclass(c, E.DrsvcError) and c is not E.DrsvcError), key=lambda c: c.__name__)


def _instance(cls):
    exc = cls.__new__(cls)
    E.DrsvcError.__init__(exc, f"{cls.__name__} happened")
    return exc


def test_the_tree_is_not_empty():
    assert len(ALL) > 40 and E.NotEnabled in ALL and E.SplitBrain in ALL


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_maps_by_its_category(cls):
    cats = [c for c in CATEGORIES if issubclass(cls, c)]
    if cls in SPECIAL:
        assert code_for(_instance(cls)) == SPECIAL[cls]
        return
    assert len(cats) == 1, f"{cls.__name__} must derive from exactly one category, not {cats}"
    assert code_for(_instance(cls)) == CATEGORIES[cats[0]]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_has_a_cli_exit_code_and_crosses_the_dispatcher(cls):
    code = code_for(_instance(cls))
    exit_code = EXIT_BY_CODE.get(code, EXIT_FAIL)
    assert exit_code != 0
    with pytest.raises(cls) as got:
        raise_from_dict(error_to_dict(_instance(cls)))
    assert type(got.value) is cls and got.value.message == f"{cls.__name__} happened"


def test_named_errors_keep_human_messages():
    assert E.NotEnabled(kind="volume", unit_id="v1").message == "replication is not enabled for volume v1"
    assert E.NotSecondary(kind="group", unit_id="g").message == "group g is not demoted; only a secondary resyncs"
    assert E.NeedsResync(unit_id="v1").message == "v1 needs a resync before it can be promoted"
    assert issubclass(E.StaleEpoch, E.SplitBrain) and issubclass(E.ReplicaIsPrimary, E.SplitBrain)


def test_the_table_lists_every_category():
    listed = {cls for cls, _ in CODE_TABLE}
    assert set(CATEGORIES) | set(SPECIAL) <= listed
