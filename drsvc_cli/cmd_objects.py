"""`drsvc volume ...` and `drsvc group ...`: create, list, delete, saying what changed."""
from __future__ import annotations

from . import humanize as H
from .context import client, resolve
from .errors import UsageError


# noun -> (list, delete, the id's key, what a delete removes)
def _verbs(c):
    return {"volume": (c.list_volumes, c.delete_volume, "volume_id", "volume {} deleted"),
            "group": (c.list_groups, c.delete_group, "group_id", "group {} and its volumes deleted")}


def _list_or_delete(args, out, c, site: str, noun: str):
    listing, delete, key, said = _verbs(c)[noun]
    if args.action == "list":
        return out.result(f"{noun} list", listing())
    ident = resolve(c, noun, getattr(args, key), must_exist=True)
    delete(ident)
    return out.change(f"{noun} delete", site, True, f"site {site}: " + said.format(ident),
                      {key: ident, "deleted": True})


def cmd_volume(args, out):
    if args.action == "create":
        try:
            size = H.parse_size(args.size)
        except H.BadSize as e:
            raise UsageError(str(e)) from None
    with client(args) as c:
        site = c.site()
        if args.action != "create":
            return _list_or_delete(args, out, c, site, "volume")
        group = resolve(c, "group", args.group, must_exist=True) if args.group else ""
        had = {v["volume_id"] for v in c.list_volumes()}
        v = c.create_volume(args.name, size, fs_type=args.fs_type, group_id=group)
        changed = v["volume_id"] not in had
        what = f"volume {v['volume_id']} ({H.size(v['capacity_bytes'])}, named {args.name}" + \
            (f", in group {group})" if group else ")")
        line = f"site {site}: {what} created" if changed else f"site {site}: {what} exists already; nothing changed"
        return out.change("volume create", site, changed, line, v)


def cmd_group(args, out):
    with client(args) as c:
        site = c.site()
        if args.action != "create":
            return _list_or_delete(args, out, c, site, "group")
        had = {g["group_id"] for g in c.list_groups()}
        g = c.create_group(args.name)
        changed = g["group_id"] not in had
        line = f"site {site}: group {g['group_id']} (named {args.name}) " + \
            ("created" if changed else "exists already; nothing changed")
        return out.change("group create", site, changed, line, g)


def add_parsers(sub, common) -> None:
    for noun, fn in (("volume", cmd_volume), ("group", cmd_group)):
        p = sub.add_parser(noun, help=f"create, list, delete {noun}s")
        acts = p.add_subparsers(dest="action", required=True)
        q = acts.add_parser("create", parents=[common], help=f"create a {noun}")
        q.add_argument("name")
        if noun == "volume":
            q.add_argument("--size", default="1G", help="K/M/G/T or Ki/Mi/Gi/Ti (both 1024-based); default 1G")
            q.add_argument("--fs-type", default="ext4", choices=["ext4", "xfs"])
            q.add_argument("--group", help="join this volume group (id or unique prefix)")
        acts.add_parser("list", parents=[common], help=f"list {noun}s")
        q = acts.add_parser("delete", parents=[common], help=f"delete a {noun} (not found: exit 5)")
        q.add_argument(f"{noun}_id", metavar="ID", help="id or unique prefix")
        p.set_defaults(fn=fn)
