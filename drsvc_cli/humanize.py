"""Sizes, durations and instants for people (the CLI and the demo), and size parsing."""
from __future__ import annotations

import datetime as dt
import re

_BIN = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)
MIN_SIZE = 1 << 20


class BadSize(ValueError):
    pass


def parse_size(text: str) -> int:
    """'10G', '512Mi', '1.5GiB', '1048576' -> bytes. K/M/G/T and Ki/Mi/Gi/Ti are both powers
    of 1024, as for truncate(1) and losetup. Zero, a bad suffix or less than 1 MiB is refused."""
    m = _SIZE.match(text or "")
    if not m or (m.group(3) and not m.group(2) and m.group(3).lower() != "b"):
        raise BadSize(f"--size {text!r}: expected a number with an optional K, M, G or T suffix "
                      "(or Ki, Mi, Gi, Ti), e.g. 10G or 512Mi")
    n = int(float(m.group(1)) * _BIN[m.group(2).lower()])
    if n <= 0:
        raise BadSize(f"--size {text!r}: a volume needs a size above zero")
    if n < MIN_SIZE:
        raise BadSize(f"--size {text!r} is {n} bytes; the smallest volume is 1Mi (sizes round up to MiB)")
    return n


def size(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def rate(bps) -> str:
    return f"{size(bps)}/s"


def duration(s) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 10:
        return f"{s:.2f}s"
    if s < 60:
        return f"{s:.0f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def short_instant(ts, now: float) -> str:
    """'22:15:03 (12s ago)' today, '11-21 22:15 (1d02h ago)' otherwise: for tables whose header says UTC."""
    if not ts:
        return "never"
    when, today = dt.datetime.fromtimestamp(ts, dt.UTC), dt.datetime.fromtimestamp(now, dt.UTC)
    text = when.strftime("%H:%M:%S" if when.date() == today.date() else "%m-%d %H:%M")
    delta = now - ts
    rel = duration(abs(delta)) if abs(delta) >= 10 else f"{abs(delta):.0f}s"
    return f"{text} ({rel} ago)" if delta >= 0 else f"{text} (in {rel})"


def instant(ts, now: float | None = None) -> str:
    """'2026-11-22 22:15:03 UTC (12s ago)' / '(in 3s)'; 'never' for none."""
    if not ts:
        return "never"
    text = dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if now is None:
        return text
    delta = now - ts
    return f"{text} ({duration(delta)} ago)" if delta >= 0 else f"{text} (in {duration(-delta)})"
