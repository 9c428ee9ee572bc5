"""`drsvc`: DR runbooks over the plugin socket (the same API a CO uses).

One module per command group: cmd_site, cmd_objects (volume, group), cmd_replication (enable,
disable, promote, demote, resync, sync-now, clone), cmd_status, cmd_points, cmd_verify, cmd_services (worker,
scheduler, metrics, flower, demo). Every state-changing command says what changed and where
(drsvc_cli/changes.py). Exit codes (drsvc_cli/errors.py, also in the README): 0 success,
1 failure, 2 usage error, 3 retryable (operation in progress or site unavailable), 4 refused
(a precondition failed), 5 not found. With --json every command prints one JSON object on its
last line.
"""
from __future__ import annotations

import argparse
import sys

import grpc

from . import cmd_objects, cmd_points, cmd_replication, cmd_services, cmd_site, cmd_status, cmd_verify
from .errors import EXIT_BY_CODE, EXIT_FAIL, EXIT_NOT_FOUND, EXIT_OK, EXIT_REFUSED, EXIT_RETRY, EXIT_USAGE  # noqa: F401
from .errors import CliError, UsageError
from .output import Output


class ArgParser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting, so usage errors honour --json."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _parents() -> tuple[ArgParser, ArgParser]:
    common = ArgParser(add_help=False)
    common.add_argument("--config", default=None, help="site config (TOML; default $DRSVC_CONFIG)")
    common.add_argument("--endpoint", help="plugin socket, unix:///path (instead of --config)")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument("--timeout", type=float, default=60.0, help="per-RPC timeout, seconds")
    unit = ArgParser(add_help=False)
    unit.add_argument("--volume", help="volume id (or a unique prefix of one)")
    unit.add_argument("--group", help="volume group id (or a unique prefix of one)")
    return common, unit


def build_parser() -> argparse.ArgumentParser:
    from drsvc import __version__
    common, unit = _parents()
    ap = ArgParser(prog="drsvc", description="drsvc disaster-recovery runbooks",
                   epilog="exit codes: 0 ok, 1 failure, 2 usage, 3 retryable, 4 refused, 5 not found")
    ap.add_argument("--version", action="version", version=f"drsvc {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    cmd_site.add_parsers(sub, common)
    cmd_objects.add_parsers(sub, common)
    cmd_replication.add_parsers(sub, common, unit)
    cmd_status.add_parsers(sub, common, unit)
    cmd_points.add_parsers(sub, common, unit)
    cmd_verify.add_parsers(sub, common, unit)
    cmd_services.add_parsers(sub, common)
    return ap


def _command_of(argv) -> str:
    words = [w for w in argv if not w.startswith("-")]
    if len(words) > 1 and words[0] in ("volume", "group", "site", "demo"):
        return " ".join(words[:2])
    return words[0] if words else "drsvc"


def _run(args, out: Output, command: str) -> int:
    from drsvc.errors import DrsvcError

    from .client import RpcFailed
    from .context import check_unit_args, unauthenticated_hint, unavailable_hint
    try:
        if getattr(args, "needs_unit", False):
            check_unit_args(args)           # before the config is read: the usage error first
        return args.fn(args, out)
    except CliError as e:
        return out.error(command, e.code, e.message, e.exit_code)
    except RpcFailed as e:
        hint = {grpc.StatusCode.UNAVAILABLE: unavailable_hint,
                grpc.StatusCode.UNAUTHENTICATED: unauthenticated_hint}.get(e.code, lambda _a: "")(args)
        return out.error(command, e.code.name, e.message + hint, EXIT_BY_CODE.get(e.code, EXIT_FAIL))
    except Exception as e:  # noqa: BLE001 - a runbook gets a message and a code, not a traceback
        msg = e.message if isinstance(e, DrsvcError) else f"{type(e).__name__}: {e}"
        return out.error(command, type(e).__name__, msg, EXIT_FAIL)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return Output(as_json).error(_command_of(argv), e.code, e.message, e.exit_code)
    out = Output(getattr(args, "json", False) or as_json)
    command = args.command + (f" {args.action}" if getattr(args, "action", None) else "")
    return _run(args, out, command)


if __name__ == "__main__":
    raise SystemExit(main())
