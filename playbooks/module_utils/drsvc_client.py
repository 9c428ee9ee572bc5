"""Client code the drsvc Ansible modules share (playbooks/library/drsvc_*.py).

One site's plugin socket through drsvc_cli.client.DrClient: connect (failing fast when the
socket does not answer), resolve a unit's id or unique id prefix through the same Admin API the
CLI uses (drsvc_cli.context.resolve), and repeat calls answered ABORTED (in progress), as a
container orchestrator does. Ansible finds this directory beside the playbooks; for ad-hoc
runs set ANSIBLE_MODULE_UTILS=playbooks/module_utils.
"""
from __future__ import annotations

try:
    import grpc
    from drsvc_cli.client import DrClient, RpcFailed
    from drsvc_cli.context import resolve
    from drsvc_cli.errors import CliError
    IMPORT_ERROR = None
except ImportError as e:  # reported through fail_json, not a traceback
    IMPORT_ERROR = e

# the options every drsvc module takes (each module documents them)
UNIT_ARGS = dict(
    endpoint=dict(type="str", required=True),
    volume_id=dict(type="str"),
    group_id=dict(type="str"),
    wait=dict(type="float", default=120),
    connect_timeout=dict(type="float", default=10),
    secrets=dict(type="dict", no_log=True),
)
UNIT_EXCLUSIVE = [("volume_id", "group_id")]


class Failed(Exception):
    def __init__(self, msg, code=None, **extra):
        super().__init__(msg)
        self.msg, self.code, self.extra = msg, code, extra


def require_client(module) -> None:
    if IMPORT_ERROR is not None:
        module.fail_json(msg=f"drsvc_cli is not importable by {module._name}'s interpreter: {IMPORT_ERROR}; "
                             "set ansible_python_interpreter to the Python that has drsvc installed")


class SiteUnit:
    """A connected client of one site and the unit the task names (a whole id or a unique prefix)."""

    def __init__(self, module):
        p = module.params
        self.module, self.p = module, p
        self.endpoint = p["endpoint"]
        self.kind = "volume" if p["volume_id"] else "volume group"
        self.client = DrClient(self.endpoint, secrets=p["secrets"] or {})
        try:
            grpc.channel_ready_future(self.client.channel).result(timeout=p["connect_timeout"])
        except grpc.FutureTimeoutError:
            self.client.close()
            raise Failed(f"endpoint {self.endpoint} is unreachable (no answer in {p['connect_timeout']}s)",
                         code="UNAVAILABLE") from None
        given = p["volume_id"] or p["group_id"]
        try:
            self.name = resolve(self.client, "volume" if p["volume_id"] else "group", given)
        except CliError as e:
            raise Failed(f"{self.kind} {given} at {self.endpoint}: {e.message}", code=e.code) from None
        except RpcFailed as e:
            raise Failed(f"listing {self.kind}s at {self.endpoint}: {e.code.name}: {e.message}",
                         code=e.code.name) from None
        self.sel = {"volume_id": self.name} if p["volume_id"] else {"group_id": self.name}

    def close(self) -> None:
        self.client.close()

    def status(self):
        """The unit's status; Failed when there is none."""
        try:
            return self.client.status(**self.sel)
        except RpcFailed as e:
            raise Failed(f"status of {self.kind} {self.name} at {self.endpoint}: {e.code.name}: {e.message}",
                         code=e.code.name) from e

    def status_or_none(self):
        """The unit's status, or None when replication is not enabled for it at this site."""
        try:
            return self.client.status(**self.sel)
        except RpcFailed as e:
            # NOT_FOUND covers both "no such volume" and "not enabled"; only the latter is a state
            if e.code == grpc.StatusCode.NOT_FOUND and "not enabled" in e.message:
                return None
            raise Failed(f"status of {self.kind} {self.name} at {self.endpoint}: {e.code.name}: {e.message}",
                         code=e.code.name) from e

    def retry(self, what, fn):
        """*fn* repeated while it answers ABORTED, up to the task's wait."""
        try:
            return self.client.until_done(fn, wait=self.p["wait"])
        except RpcFailed as e:
            raise Failed(f"{what} at {self.endpoint} failed: {e.code.name}: {e.message}", code=e.code.name,
                         retryable=e.retryable) from e

    def call(self, method, **fields):
        """One replication RPC on the unit, repeated while in progress."""
        return self.retry(f"{method} of {self.kind} {self.name}",
                          lambda: self.client.replication(method, **self.sel, **fields))
