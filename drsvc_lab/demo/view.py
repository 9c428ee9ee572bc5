"""How `drsvc demo` prints: rich tables and plain lines, never a Python repr.

The demo (``run``) keeps each step's result as plain data for `--json`;
this module turns those results into text for people. Piped output gets a fixed,
wide console (120 columns, or $COLUMNS), so a log file or a closing note reads
like the terminal did.
"""
from __future__ import annotations

import os
import sys

from drsvc_cli import humanize as H

PIPED_WIDTH = 120


def make_console(file=None):
    from rich.console import Console
    out = file or sys.stdout
    if out.isatty():
        return Console(file=out)
    try:
        width = max(PIPED_WIDTH, int(os.environ.get("COLUMNS") or 0))
    except ValueError:
        width = PIPED_WIDTH
    return Console(file=out, width=width, no_color=True, highlight=False, soft_wrap=False)


def text(value) -> str:
    """One cell: lists become comma-separated, dicts 'k v, k v'; nothing prints as a repr."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(text(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def pairs(detail: dict, width: int = PIPED_WIDTH):
    """A step's result as indented 'key  value' lines, wrapped under the value (no table:
    nothing pads the lines)."""
    import textwrap

    from rich.text import Text
    keyw = max((len(str(k)) for k in detail), default=0)
    hang = keyw + 6
    out = Text()
    for i, (k, v) in enumerate(detail.items()):
        lines = [w for ln in (text(v).splitlines() or [""])
                 for w in (textwrap.wrap(ln, max(20, width - hang), break_long_words=False,
                                         break_on_hyphens=False) or [""])]
        out.append(("\n" if i else "") + f"    {str(k):<{keyw}}  ", style="bold")
        out.append(lines[0])
        for ln in lines[1:]:
            out.append("\n" + " " * hang + ln)
    return out


def table(title: str | None, columns: list[str], rows: list[list], *, right: tuple = ()):
    from rich.table import Table
    t = Table(title=title, title_justify="left", padding=(0, 1))
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold")
    for r in rows:
        t.add_row(*[text(c) for c in r])
    return t


def sync_table(rounds: list[dict], *, rsync: bool):
    """Per sync of the database volume: what the application wrote, what changed at block
    level, what drsvc put on the wire and how long it took, and rsync's cost for the same change."""
    from rich.table import Table
    t = Table(padding=(0, 1))
    # the label wraps (a row that took in scheduled syncs says so and grows); the figures never do
    t.add_column("writes at a, then a sync", overflow="fold")
    cols = ["app wrote", "changed", "drsvc sent", "took"] + (["rsync sent", "took", "rsync/drsvc"] if rsync else [])
    for c in cols:
        t.add_column(c, justify="right", no_wrap=True, min_width=len(c))
    for r in rounds:
        label = r["label"] if r.get("syncs", 1) <= 1 else f"{r['label']} ({r['syncs']} syncs)"
        row = [label, H.size(r["app_bytes"]) if r.get("app_bytes") is not None else "-",
               H.size(r["bytes_changed"]), H.size(r["bytes_on_wire"]), H.duration(r["seconds"])]
        if rsync:
            rs = r.get("rsync")
            row += ([H.size(rs["bytes_sent"]), H.duration(rs["seconds"]),
                     f"{rs['bytes_sent'] / r['bytes_on_wire']:.1f}x" if r["bytes_on_wire"] else "-"]
                    if rs else ["-", "-", "-"])
        t.add_row(*row)
    return t


def summary_table(summary: dict):
    rows = [[s["step"], "ok" if s["ok"] else "FAILED", f"{s['seconds']:.1f}"] for s in summary["steps"]]
    return table(None, ["step", "result", "seconds"], rows, right=("seconds",))


def summary_title(summary: dict) -> str:
    return f"drsvc demo: {'PASSED' if summary['ok'] else 'FAILED'} in {summary['seconds']:.1f}s"


SYNC_NOTE = """\
    changed: the 4 KiB blocks that differ, found from the extent map of drsvc's reflink capture.
    rsync: --no-whole-file --inplace between reflink copies of the image before and after the writes; it reads
    both whole images and sends its own (larger) blocks around each change. It runs locally, with no ssh.
    A row that counts 2 syncs took in a scheduled sync that ran during its writes; "took" is the last one's."""


def next_steps(commands: dict):
    """The sites left running (`demo --keep`): ready-to-paste commands, one per line."""
    from rich.text import Text
    out = Text("sites left running; next:\n", style="bold")
    keyw = max(len(k) for k in commands)
    for k, v in commands.items():
        out.append(f"    {k:<{keyw}}  ", style="bold")
        out.append(v + "\n")
    return out
