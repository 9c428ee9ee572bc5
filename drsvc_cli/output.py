"""How the CLI prints: lines and tables for people (human sizes, durations, UTC times), one
JSON object for machines (times as RFC 3339, durations in seconds)."""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys

from . import humanize as H
from .errors import EXIT_OK


def rfc3339(ts) -> str | None:
    """Unix seconds -> '2026-11-25T16:20:01.250Z'; None for none (0 means none, as on the wire)."""
    if not ts:
        return None
    return dt.datetime.fromtimestamp(float(ts), dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def for_json(value):
    """Instants (keys ending _time or _at) as RFC 3339; everything else as it is."""
    if isinstance(value, dict):
        return {k: rfc3339(v) if k.endswith(("_time", "_at")) and isinstance(v, (int, float)) and
                not isinstance(v, bool) else for_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [for_json(v) for v in value]
    return value


class Output:
    """Tables and progress for people; one JSON object for machines."""

    def __init__(self, as_json: bool):
        self.json = as_json
        self.console = None
        if not as_json:
            from rich.console import Console
            self.console = Console()

    def result(self, command: str, result, **extra) -> int:
        """*extra*: more top-level fields of the --json answer (a page's next_token)."""
        if self.json:
            print(json.dumps({"ok": True, "command": command, "result": for_json(result), **extra}, sort_keys=True,
                             default=str))
        elif isinstance(result, list) and result and isinstance(result[0], dict):
            self.table(result)
        elif isinstance(result, dict):
            self.table([{"field": k, "value": v} for k, v in result.items()])
        elif result is not None:
            self.console.print(result)
        return EXIT_OK

    def change(self, command: str, site: str, changed: bool, line: str, result: dict, table=None) -> int:
        """A state-changing command: what changed and where. Plain: the sentence (and a table);
        --json: the result with `changed` and `site`."""
        if self.json:
            return self.result(command, {**result, "changed": changed, "site": site})
        from rich.markup import escape
        self.console.print(escape(line), soft_wrap=True)
        if table:
            self.table(*table)
        return EXIT_OK

    def finding(self, command: str, result: dict, exit_code: int, code: str, message: str) -> int:
        """--json of a check that ran: its result, and when it found a fault (*exit_code* not 0)
        also the error object an automation keys on."""
        if exit_code == EXIT_OK:
            return self.result(command, result)
        print(json.dumps({"ok": False, "command": command, "exit_code": exit_code, "result": for_json(result),
                          "error": {"code": code, "message": message}}, sort_keys=True, default=str))
        return exit_code

    def error(self, command: str, code: str, message: str, exit_code: int) -> int:
        if self.json:
            print(json.dumps({"ok": False, "command": command, "exit_code": exit_code,
                              "error": {"code": code, "message": message}}, sort_keys=True))
        else:
            from rich.console import Console
            from rich.markup import escape
            Console(stderr=True).print(f"[red]error[/red] ({code}): {escape(message)}", soft_wrap=True)
        return exit_code

    def table(self, rows: list[dict], columns: list[str] | None = None, title: str | None = None) -> None:
        from rich.table import Table
        from rich.text import Text
        cols = columns or list(rows[0].keys())
        t = Table(title=title)
        for c in cols:
            cells = [cell(c, r.get(c)) for r in rows]
            if is_id(c):      # ids are never cut: an operator copies them into the next command
                width = max([len(line) for x in cells for line in x.splitlines()] + [len(c)])
                t.add_column(c, no_wrap=True, min_width=width)
            else:
                t.add_column(c, overflow="fold")
        for r in rows:
            t.add_row(*[Text(cell(c, r.get(c))) for c in cols])
        self.console.print(t)

    def progress(self, label: str):
        """A spinner in a terminal; silent with --json or without a tty."""
        if self.json or not sys.stderr.isatty():
            return contextlib.nullcontext(lambda msg: None)
        from rich.console import Console
        return _Spinner(Console(stderr=True).status(label), label)


class _Spinner:
    def __init__(self, status, label: str):
        self.status, self.label = status, label

    def __enter__(self):
        self.status.__enter__()
        return lambda msg: self.status.update(f"{self.label}: {msg}")

    def __exit__(self, *exc):
        self.status.__exit__(*exc)


def is_id(column: str) -> bool:
    return column in ("unit", "unit_id", "volumes", "members", "source", "clone") or column.endswith("_id")


def cell(column: str, v) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, list):
        return "\n".join(map(str, v)) or "-"
    if isinstance(v, dict):
        return ", ".join(f"{k}={cell(k, x)}" for k, x in v.items())
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return _number(column, v)
    return str(v)


def _number(column: str, v) -> str:
    if column.endswith("bytes") or column in ("bytes_on_wire", "bytes_changed", "size"):
        return f"{H.size(v)} ({v})" if column == "capacity_bytes" else H.size(v)
    if column.endswith(("_seconds", "_s", "duration")):
        return H.duration(v)
    if column.endswith("_time") or column.endswith("_at"):
        return H.instant(v)
    return str(v)
