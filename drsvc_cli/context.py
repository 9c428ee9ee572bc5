"""What every command needs: the site config, the plugin endpoint, a connected client, and
the unit an id (or a unique prefix of one) names."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import NotFoundError, Unreachable, UsageError

CONNECT_S = 5.0


def config_path(args) -> str | None:
    """--config, else $DRSVC_CONFIG."""
    return getattr(args, "config", None) or os.environ.get("DRSVC_CONFIG")


def load_config(path):
    """Load a site config; a missing or unreadable file is a usage error, said plainly."""
    from drsvc.config import load
    if not path:
        raise UsageError("give --config site.toml (or set DRSVC_CONFIG)")
    if not Path(path).is_file():
        raise UsageError(f"config file {path} does not exist")
    try:
        return load(path)
    except Exception as e:  # noqa: BLE001 - any parse problem is the caller's input
        msg = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
        raise UsageError(f"config file {path}: {msg}") from None


def endpoint(args) -> str:
    """--endpoint or the config's; both given is a usage error (which site was meant?)."""
    if getattr(args, "config", None) and args.endpoint:
        raise UsageError(f"give --config or --endpoint, not both: --config {args.config} names its own endpoint "
                         f"and --endpoint {args.endpoint} may be another site's")
    if args.endpoint:
        return args.endpoint
    if path := config_path(args):
        return load_config(path).endpoint
    if os.environ.get("CSI_ENDPOINT"):
        return os.environ["CSI_ENDPOINT"]
    raise UsageError("give --config or --endpoint (or set DRSVC_CONFIG / CSI_ENDPOINT)")


def secrets(args) -> dict:
    """The secrets every call carries: the site's RPC token when its config names a
    secrets_file (the plugin then refuses a call without it). An unreadable token file is a
    usage error that names it; the token itself is never printed."""
    path = config_path(args)
    if not path or getattr(args, "endpoint", None):
        return {}
    cfg = load_config(path)
    if cfg.secrets_file is None:
        return {}
    try:
        token = Path(cfg.secrets_file).read_text().strip()
    except OSError as e:
        raise UsageError(f"config file {path}: its secrets_file {cfg.secrets_file} cannot be read "
                         f"({e.strerror or type(e).__name__}); the plugin refuses calls without its token") from None
    return {"token": token} if token else {}


def _site_hint(args) -> str:
    path = config_path(args)
    return f"drsvc site status --config {path}" if path else "drsvc site status --config SITE.toml"


def client(args):
    """A client of the plugin socket that answers, or Unreachable naming the socket and what to
    run next."""
    import grpc

    from drsvc.config import socket_path

    from .client import DrClient
    ep = endpoint(args)
    try:
        sock = socket_path(ep)
    except Exception:  # noqa: BLE001 - a malformed endpoint: the plugin client says why
        sock = None
    wait = min(CONNECT_S, args.timeout)
    if sock is not None and not sock.exists():
        raise Unreachable(f"the plugin at {sock} is unreachable (no such socket); is the site up? "
                          f"see `{_site_hint(args)}`")
    c = DrClient(ep, timeout=args.timeout, secrets=secrets(args))
    try:
        grpc.channel_ready_future(c.channel).result(timeout=wait)
    except grpc.FutureTimeoutError:
        c.close()
        raise Unreachable(f"the plugin at {sock or ep} is unreachable (nothing answered within {wait:.0f}s); "
                          f"is the site up? see `{_site_hint(args)}`") from None
    return c


def unavailable_hint(args) -> str:
    return f"; is the site up? see `{_site_hint(args)}`"


def unauthenticated_hint(args) -> str:
    if config_path(args) and not getattr(args, "endpoint", None):
        return ""
    return "; give --config of the site (its secrets_file holds the token the plugin asks for)"


def check_unit_args(args) -> None:
    if getattr(args, "all", False):
        held = "primary" if args.command == "demote" else "secondary"
        if args.volume or args.group or getattr(args, "point", None):
            raise UsageError(f"--all takes every unit held here as {held}: give it without --volume, "
                             "--group or --point")
        return
    if getattr(args, "dry_run", False):
        raise UsageError("--dry-run goes with --all")
    if getattr(args, "resync", False):
        raise UsageError("--resync goes with --all (one unit: drsvc resync --force)")
    if bool(args.volume) == bool(args.group):
        raise UsageError("give exactly one of --volume or --group")


def unit(args, c) -> dict:
    """{"volume_id": ...} or {"group_id": ...}, a unique id prefix resolved."""
    check_unit_args(args)
    return {"volume_id": resolve(c, "volume", args.volume)} if args.volume else \
        {"group_id": resolve(c, "group", args.group)}


def resolve(c, kind: str, text: str, *, must_exist: bool = False) -> str:
    """A whole id, or the one id that *text* is a prefix of (volumes and groups here, and the
    replication units this site holds). Ambiguous is a usage error; no match is not found when
    *must_exist*, otherwise the text is passed on for the plugin to answer. A whole id of a
    unit that replicates here is known from its status alone, without listing the site."""
    if _replicates_here(c, kind, text):
        return text
    known = set(v["volume_id"] for v in c.list_volumes()) if kind == "volume" else \
        set(g["group_id"] for g in c.list_groups())
    try:
        known |= {s["unit_id"] for s in c.statuses() if s["kind"] == kind}
    except Exception:  # noqa: BLE001 - status is a convenience here, not a requirement
        pass
    if text in known:
        return text
    matches = sorted(k for k in known if k.startswith(text))
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise UsageError(f"{kind} id prefix {text!r} is ambiguous: {', '.join(matches)}")
    if must_exist:
        raise NotFoundError(f"{kind} {text} does not exist at this site")
    return text


def _replicates_here(c, kind: str, text: str) -> bool:
    try:
        c.status(**({"volume_id": text} if kind == "volume" else {"group_id": text}))
    except Exception:  # noqa: BLE001 - not a whole id of a unit here: the listing decides
        return False
    return True
